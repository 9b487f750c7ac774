"""The memory planner's arithmetic against hand-computed cases, its ladder, and its CLI and trainer hooks."""
import dataclasses
import json

import pytest
import torch

from msa_train.parallel import planner
from msa_train.parallel.planner import ModelShape, Options, Workload
from tests.msa_train._util import FAST, compose

B = 10 ** 9
LLAMA3_8B = ModelShape(params=8_030_261_248, hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
                       head_dim=128, vocab=128256)


@pytest.mark.parametrize("zero,world,expect", [
    # bf16 mixed precision: 2 bytes parameters, 2 gradients, 12 fp32 master + AdamW moments, 4 fp32
    # gradients in the step; ZeRO-1 shards the 12 + 4, ZeRO-2 the gradients too, ZeRO-3 the parameters too
    (0, 1, dict(parameters=2 * B, gradients=2 * B, optimizer_state=12 * B, step_fp32_gradients=4 * B)),
    (0, 8, dict(parameters=2 * B, gradients=2 * B, optimizer_state=12 * B, step_fp32_gradients=4 * B)),
    (1, 8, dict(parameters=2 * B, gradients=2 * B, optimizer_state=1.5 * B, step_fp32_gradients=0.5 * B)),
    (2, 1, dict(parameters=2 * B, gradients=2 * B, optimizer_state=12 * B, step_fp32_gradients=4 * B)),
    (2, 8, dict(parameters=2 * B, gradients=0.25 * B, optimizer_state=1.5 * B, step_fp32_gradients=0.5 * B)),
    (3, 8, dict(parameters=0.25 * B, gradients=0.25 * B, optimizer_state=1.5 * B, step_fp32_gradients=0.5 * B)),
], ids=["zero0-w1", "zero0-w8", "zero1-w8", "zero2-w1", "zero2-w8", "zero3-w8"])
def test_model_state_of_a_1b_model(zero, world, expect):
    got = planner.model_state_bytes(B, Options(zero_stage=zero), world)
    assert {k: got[k] for k in expect} == pytest.approx(expect)
    assert got["host_optimizer"] == got["host_parameters"] == 0


@pytest.mark.parametrize("ratio", [1.0, 0.75, 0.3])
def test_a_partial_offload_splits_the_optimizer_state_between_host_and_gpu(ratio):
    """ZeRO-3 on one rank, ``offload_ratio`` r: the host holds r of the 12 + 4 bytes a parameter of
    optimizer state and fp32 gradients and every bf16 gradient partition (2), the GPU the rest of the
    16, resident from the start; the parameters stay on the GPU (2)."""
    got = planner.model_state_bytes(B, Options(zero_stage=3, offload_optimizer=True, offload_ratio=ratio,
                                               optimizer="deepspeed"), 1)
    assert got["host_optimizer"] == pytest.approx((16 * ratio + 2) * B)
    assert got["optimizer_state"] == pytest.approx(16 * (1 - ratio) * B, abs=1)
    assert got["parameters"] == pytest.approx(2 * B) and got["gradients"] == got["step_fp32_gradients"] == 0
    zero2 = planner.model_state_bytes(B, Options(zero_stage=2, offload_optimizer=True, offload_ratio=ratio), 1)
    assert zero2["host_optimizer"] == pytest.approx(16 * B)  # ZeRO-2 offloads all of it, whatever the ratio


def test_host_share_counts_deepspeeds_sub_groups_not_elements():
    """DeepSpeed splits a partial offload by sub-groups: its own grouping (stage3.py's
    _create_fp16_sub_groups) of parameters of hand-picked sizes, with its placement rule (the first
    int((1 - r) n) sub-groups on the GPU) and partition size (rounded up), restated here from
    stage3.py and partition_parameters.py, give the planner's host share on one rank and on two."""
    import types

    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    numels = [525, 50, 60, 70, 30, 41, 7, 525]
    # sub-groups close once they hold >= 100: [525], [50, 60], [70, 30], [41, 7, 525]
    assert planner.host_share(numels, 0.5, sub_group=100) == pytest.approx((100 + 573) / 1308)
    assert planner.host_share(numels, 0.8, sub_group=100) == 1.0  # int(0.2 * 4) = 0 sub-groups on the GPU
    assert planner.host_share([], 0.8) == 0.8  # sizes unknown: the ratio as given
    for world in (1, 2):
        params = [types.SimpleNamespace(partition_numel=lambda n=-(-n // world): n) for n in numels]
        groups = DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups(types.SimpleNamespace(sub_group_size=100), params)
        sizes = [sum(p.partition_numel() for p in g) for g in groups]
        for ratio in (0.95, 0.75, 0.5, 0.3):
            on_host = [i >= int((1 - ratio) * len(sizes)) for i in range(len(sizes))]
            expect = sum(s for s, h in zip(sizes, on_host) if h) / sum(sizes)
            assert planner.host_share(numels, ratio, world, sub_group=100) == pytest.approx(expect), (world, ratio)


def test_the_planner_reads_the_models_sub_groups():
    """Llama-3-8B with NSA at ``offload_ratio`` 0.8: the embedding's 525M elements make the GPU's
    first sub-group, so the host holds 0.773 of the optimizer state (the 32-layer H200 points'
    peaks: 4% under the measured with the ratio as given, within 1% with this)."""
    cfg = compose(["recipe=llama3_8b_64k", "data=generated", "model=llama3_8b", "attention=fmsa"])
    shape = ModelShape.from_config(cfg.model, cfg.attention)
    assert sum(shape.trained_numels) == shape.params
    assert planner.host_share(shape.trained_numels, 0.8) == pytest.approx(0.773, abs=1e-3)


def test_the_ladder_splits_the_optimizer_state_for_a_host_too_small_for_it():
    """Llama-3-8B's 32 layers at 64K on an 80 GB GPU whose host has 124 GiB: all of the optimizer
    state on the host needs 16 x 8.03e9 bytes = 119.7 GiB, plus the process's 6, so the fix keeps a
    part of it on the GPU: the largest host share r with 16r x 8.03e9 + 2 x 8.03e9 bytes (the bf16
    gradient buffer) + 6 GiB <= 124 GiB, r <= 0.86 -> 0.85, that the GPU has room for."""
    opt = Options(zero_stage=2, offload_optimizer=True, activation_checkpointing=True, tile_tokens=32768,
                  optimizer="deepspeed")
    result = planner.plan(LLAMA3_8B, opt, Workload(seq_len=65536), gpu_gb=79.2, host_limit_gb=124.0)
    assert not result.fits and result.host_need_gb == pytest.approx(16 * 8.03026 * B / planner.GiB + 6, rel=1e-3)
    assert result.fix == ["parallel.zero_stage=3", "parallel.offload_ratio=0.85"], result.fix
    fixed = planner.predict(LLAMA3_8B, dataclasses.replace(opt, zero_stage=3, offload_ratio=0.85), Workload(seq_len=65536),
                            gpu_gb=79.2, host_limit_gb=124.0)
    assert fixed.fits and fixed.host_need_gb == pytest.approx((0.85 * 16 + 2) * 8.03026 * B / planner.GiB + 6, rel=1e-3)


def test_offloaded_state_moves_to_the_host():
    got = planner.model_state_bytes(B, Options(zero_stage=3, offload_optimizer=True, offload_params=True), 8)
    assert got["optimizer_state"] == got["step_fp32_gradients"] == got["parameters"] == 0
    # (12 + 4) / 8 bytes per parameter, and ZeRO-3's host buffer of bf16 gradient partitions, 2 / 8
    assert got["host_optimizer"] == pytest.approx(2.25 * B)
    assert got["host_parameters"] == pytest.approx(0.25 * B)
    fp32 = planner.model_state_bytes(B, Options(), 1, bf16=False)  # torch AdamW on fp32 weights: no master copy
    assert (fp32["parameters"], fp32["gradients"], fp32["optimizer_state"]) == (4 * B, 4 * B, 8 * B)


def test_layer_bytes_per_token_match_the_measured_llama3_layer():
    # parallel/memory.py counted 197 KiB per token (HF norms, plain MLP) and 53 tiled, with hooks
    plain = planner.layer_saved_bytes_per_token(LLAMA3_8B, Options(fused_ops=False))
    assert plain == {"norms": 2 * 24 * 1024, "mlp": 120 * 1024, "attention": 28 * 1024 + 128}
    assert sum(plain.values()) / 1024 == pytest.approx(197, rel=0.01)
    tiled = planner.layer_saved_bytes_per_token(LLAMA3_8B, Options(fused_ops=False, tile_tokens=32768))
    assert sum(tiled.values()) / 1024 == pytest.approx(53, rel=0.02)


@pytest.mark.parametrize("fused,saved", [(True, 3), (False, 4)])
def test_a_tiled_mlp_backward_holds_one_tile_recomputed_beside_its_gradients(fused, saved):
    """TiledMLP differentiates one tile at a time after recomputing its forward: the tile's saved
    SwiGLU tensors (3 x I fused, 4 plain) and its two T x I gradients, on top of the layer's saved
    tensors and the incoming hidden gradient (the e2e report's tiled points measured this)."""
    T, tile, a = 131072, 32768, 2
    work = Workload(seq_len=T)
    opt = Options(activation_checkpointing=True, fused_ops=fused, tile_tokens=tile)
    per = planner.layer_saved_bytes_per_token(LLAMA3_8B, opt, a)
    in_mlp = sum(per.values()) * T + a * 4096 * T + (2 + saved) * a * 14336 * tile
    assert planner.activation_bytes(LLAMA3_8B, opt, work)["layer_working"] == pytest.approx(in_mlp)


def test_checkpointing_keeps_one_input_per_layer_and_offload_moves_them_to_the_host():
    T = 65536
    work = Workload(seq_len=T)
    ckpt = planner.activation_bytes(LLAMA3_8B, Options(activation_checkpointing=True), work)
    assert ckpt["activations_kept"] == 32 * T * 4096 * 2  # 16 GiB: 32 bf16 layer inputs
    # offloaded: on the device only the input of the layer being recomputed. HF's norm saves an fp32
    # copy, not that tensor, so it counts once more; a fused or tiled norm saves it, and the layer's
    # working set has it already (counted twice, the planner was 14.5% over the 1M run's measured peak)
    off = planner.activation_bytes(LLAMA3_8B, Options(activation_checkpointing=True, offload_activations=True,
                                                      fused_ops=False), work)
    assert off["host_activations"] == ckpt["activations_kept"] and off["activations_kept"] == T * 4096 * 2
    for slim in (Options(activation_checkpointing=True, offload_activations=True),  # fused_ops: the default
                 Options(activation_checkpointing=True, offload_activations=True, fused_ops=False, tile_tokens=32768)):
        with_slim_norms = planner.activation_bytes(LLAMA3_8B, slim, work)
        assert with_slim_norms["host_activations"] == ckpt["activations_kept"]
        assert with_slim_norms["activations_kept"] == 0
    plain = planner.activation_bytes(LLAMA3_8B, Options(), work)
    assert plain["activations_kept"] > 10 * ckpt["activations_kept"]


def test_sequence_parallel_heads_and_tokens():
    assert planner.rank_heads(32, 8, 4) == (8, 2)
    assert planner.rank_heads(40, 8, 16) == (2, 1)  # KV heads replicated past HK
    one = planner.activation_bytes(LLAMA3_8B, Options(activation_checkpointing=True), Workload(seq_len=1 << 20))
    eight = planner.activation_bytes(LLAMA3_8B, Options(activation_checkpointing=True, sp_degree=8),
                                     Workload(seq_len=1 << 20, world_size=8))
    assert eight["activations_kept"] == one["activations_kept"] / 8
    assert eight["layer_working"] == pytest.approx(one["layer_working"] / 8, rel=0.01)


def test_zero_reduces_gradients_through_deepspeeds_bucket():
    """ZeRO 1-3 reduce the gradients through a device buffer of reduce_bucket_size elements in the
    model's dtype: ZeRO-1/2 during each backward, ZeRO-3 for the whole run. ZeRO-0 has none."""
    work = Workload(seq_len=65536)
    bucket = planner.REDUCE_BUCKET_ELEMENTS * 2 / planner.GiB  # bf16: 0.93 GiB
    assert bucket == pytest.approx(0.931, abs=1e-3)
    zero0 = planner.predict(LLAMA3_8B, Options(zero_stage=0), work, gpu_gb=1e9)
    assert zero0.parts["reduce_bucket"] == 0
    for stage in (1, 2, 3):
        plan = planner.predict(LLAMA3_8B, Options(zero_stage=stage), work, gpu_gb=1e9)
        assert plan.parts["reduce_bucket"] == pytest.approx(bucket)
    fp32 = planner.predict(LLAMA3_8B, Options(zero_stage=2), Workload(seq_len=65536, bf16=False), gpu_gb=1e9)
    assert fp32.parts["reduce_bucket"] == pytest.approx(2 * bucket)
    # the backward's peak holds it (hand-summed: the optimizer state and gradients offloaded)
    one, two = (planner.predict(LLAMA3_8B, Options(zero_stage=z, offload_optimizer=True), work, gpu_gb=1e9)
                for z in (1, 2))
    assert two.allocated_gb == pytest.approx(two.parts["parameters"] + two.parts["activations_kept"]
                                             + two.parts["loss_held"] + bucket
                                             + max(two.parts["loss"], two.parts["layer_working"]
                                                   + two.parts["attention_workspace"]))
    assert one.allocated_gb == pytest.approx(two.allocated_gb)  # offloaded: ZeRO-1 and 2 keep the same on the GPU


def test_the_ladder_picks_the_first_option_that_fits():
    work = Workload(seq_len=65536, attention="fmsa")
    base = Options(zero_stage=2)
    kept = planner.predict(LLAMA3_8B, base, work, gpu_gb=1e9)
    ckpt = planner.predict(LLAMA3_8B, Options(zero_stage=2, activation_checkpointing=True), work, gpu_gb=1e9)
    between = (kept.peak_gb + ckpt.peak_gb) / 2  # fits with checkpointing, not without
    result = planner.plan(LLAMA3_8B, base, work, gpu_gb=between)
    assert not result.fits and result.fix == ["parallel.activation_checkpointing=true"]
    # 40 GB: nothing short of the optimizer state on the host fits the 8B model; ZeRO-0 moves to ZeRO-2 for it
    small = planner.plan(LLAMA3_8B, Options(), Workload(seq_len=8192), gpu_gb=40)
    assert {"parallel.zero_stage=2", "parallel.offload_optimizer=true"} <= set(small.fix), small.fix
    assert "parallel.offload_params=true" not in small.fix
    assert planner.plan(LLAMA3_8B, Options(), Workload(seq_len=1 << 24), gpu_gb=8).fix == []  # nothing fits
    steps = planner.ladder(Options(), Workload(seq_len=65536, world_size=8))
    assert [s.sp_degree for s in steps][-3:] == [2, 4, 8]


def test_a_plan_that_does_not_fit_names_the_fewest_gpus_it_fits_as_it_is():
    """ZeRO shards the model state over the GPUs: Llama-3-8B at 64K with ZeRO-2 and checkpointing
    (the recipe llama3_8b_64k) is 158.6 GiB on one H200 and fits two; ZeRO-0 replicates it, so more
    GPUs do not help and none are named."""
    work, opt = Workload(seq_len=65536, attention="fmsa"), Options(zero_stage=2, activation_checkpointing=True)
    one = planner.plan(LLAMA3_8B, opt, work, gpu_gb=139)
    assert not one.fits and one.fit_world == 2 and one.to_dict()["fit_world"] == 2
    assert planner.plan(LLAMA3_8B, opt, dataclasses.replace(work, world_size=2), gpu_gb=139).fits
    assert "as it is, on 2 GPUs of one node (train.plan_world_size=2)" in planner.render(one, "t")
    assert planner.plan(LLAMA3_8B, Options(), work, gpu_gb=139).fit_world is None
    tiny = planner.plan(LLAMA3_8B, opt, dataclasses.replace(work, seq_len=1 << 24), gpu_gb=8)
    assert tiny.fit_world is None  # not on the 8 GPUs of a node either


def test_a_plan_checks_the_host_memory_it_is_given(tmp_path, capsys):
    """train.plan_host_gb: all of Llama-3-8B's optimizer state on the host of one GPU needs about 130 GiB
    with the process, more than a 125 GiB host (docs/recipes.md); not checked without it."""
    from msa_train.cli import compose as cli_compose
    from msa_train.cli import run

    base = ["recipe=llama3_8b_64k", "parallel.offload_optimizer=true", "parallel.optimizer=deepspeed", "train.plan=true",
            "train.plan_world_size=1", "train.plan_gpu_gb=139", f"train.output_dir={tmp_path}"]
    assert run(cli_compose(base, typed=False))["fits"]
    out = run(cli_compose([*base, "train.plan_host_gb=125"], typed=False))
    assert not out["fits"] and out["host_limit_gb"] == 125 and out["host_need_gb"] > 125
    assert "parallel.offload_ratio=" in capsys.readouterr().out  # the fix keeps a share on the GPU


def test_plan_true_prints_and_writes_plan_json_without_building(tmp_path, capsys, monkeypatch):
    from msa_train.cli import compose as cli_compose
    from msa_train.cli import run

    monkeypatch.setattr("msa_train.trainer.Trainer.__init__", lambda *a: pytest.fail("the planner built a Trainer"))
    # as a user types it: no data.path (a plan reads none), the recipe's world size (8 GPUs)
    cfg = cli_compose(["recipe=qwen3_14b_1m", "train.plan=true", "parallel.sp_degree=4",
                       f"train.output_dir={tmp_path}"], typed=False)
    out = run(cfg)
    printed = capsys.readouterr().out
    assert "peak per GPU" in printed and "qwen3_14b_1m" in printed
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["workload"]["world_size"] == 8 and saved["options"]["sp_degree"] == 4
    assert saved["fits"] == out["fits"] and saved["parts_gb"]["host_optimizer"] > 0
    big = cli_compose(["recipe=qwen25_32b_128k", "train.plan=true"])
    assert big.train.plan_world_size == 8 and not big.data.paths
    with pytest.raises(ValueError, match=r"data.path is required with data.format='pretrain'"):
        cli_compose(["recipe=qwen25_32b_128k"])  # training reads its files


def test_a_run_too_big_for_the_host_stops_before_building_saying_what_it_needs(tmp_path, monkeypatch):
    from msa_train.trainer import Trainer

    monkeypatch.setattr(planner, "host_memory_gb", lambda: 0.001)
    monkeypatch.setattr("msa_train.models.build_model", lambda *a, **k: pytest.fail("built past the check"))
    cfg = compose([*FAST, f"train.output_dir={tmp_path}", "train.device=cpu"])
    with pytest.raises(ValueError, match=r"needs [\d.]+ GiB of host memory .*train.plan=true"):
        Trainer(cfg)
    cfg = compose(["recipe=qwen3_14b_1m", "data=generated", "parallel.sp_degree=1"])
    reason = planner.check_fit(cfg, 1, torch.device("cpu"))
    assert reason and "GiB of host memory" in reason


def test_parameter_counts_read_as_people_write_them():
    from msa_train.trainer import format_count

    assert format_count(15_065_000_000) == "15.1B" and format_count(123_400_000) == "123M"
    assert format_count(4_300) == "4.3K" and format_count(12) == "12"


def test_the_dry_run_stays_on_meta_when_constructors_are_given_a_device(monkeypatch):
    """count_parameters (the planner's and the trainer's dry run) builds on the meta device even when
    tensor constructors are called with a device, as DeepSpeed's zero.Init patches make them."""
    from msa_train.models import count_parameters

    made, empty = [], torch.empty

    def empty_on_cpu(*args, **kwargs):
        out = empty(*args, **{**kwargs, "device": kwargs.get("device") or "cpu"})
        made.append(out.device.type)
        return out

    monkeypatch.setattr(torch, "empty", empty_on_cpu)
    cfg = compose(["recipe=tiny_qwen3"])
    total, _ = count_parameters(cfg.model, cfg.attention)
    assert total > 0 and made and set(made) == {"meta"}


def test_the_host_fit_counts_each_process_beside_what_it_offloads():
    """32 layers of Llama-3-8B with the optimizer state on the host: 119.7 GiB offloaded was killed
    with 124.4 GiB available, so the process's own memory must count."""
    from msa_train.cli import compose

    overrides = ["recipe=llama3_8b_64k", "data=generated", "attention=full", "parallel=zero2",
                 "parallel.offload_optimizer=true", "parallel.optimizer=deepspeed", "train.plan_gpu_gb=141"]
    plan = planner.plan_of_config(compose(overrides), world_size=1, host_limit_gb=124.4)
    assert plan.host_gb == pytest.approx(119.7, abs=0.1)
    assert plan.host_need_gb == pytest.approx(plan.host_gb + planner.HOST_PROCESS_GB)
    assert not plan.fits and plan.to_dict()["host_need_gb"] == round(plan.host_need_gb, 2)
    two = planner.plan_of_config(compose([*overrides, "train.plan_world_size=2"]), host_limit_gb=124.4)
    assert two.host_need_gb == pytest.approx(2 * (two.host_gb + planner.HOST_PROCESS_GB))
