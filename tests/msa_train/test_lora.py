"""LoRA through peft (model.lora.*, msa_train/models/lora.py) on CPU: what trains, what a checkpoint
holds, exact resume, the merged HF export, evaluation and generate() merged and unmerged, and the
memory planner's count."""
import json

import pytest
import torch

from tests.msa_train._util import FAST, compose, read_metrics, train


def _args(out, *more):
    return [*FAST, "attention=nsa", "model.lora.r=4", "model.lora.alpha=8", "train.lr=1e-2", "train.warmup_steps=1",
            f"train.output_dir={out}", *more]


def _trainer(args):
    from msa_train.trainer import Trainer

    return Trainer(compose(args))


def test_lora_trains_the_adapters_and_nsa_and_exports_a_merged_model(tmp_path):
    from msa_train.models import load_pretrained
    from msa_train.models.lora import count_trainable

    args = _args(tmp_path, "train.steps=3", "train.save_hf=true")
    trainer = _trainer(args)
    model = trainer.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or ".nsa." in n for n in trainable)
    assert any(".nsa.compress_k." in n for n in trainable) and any(".nsa.gate." in n for n in trainable)
    assert not any(n.endswith(("lm_head.weight", "embed_tokens.weight")) for n in trainable)
    # the planner's count (from the meta model) is what apply_lora made trainable
    from msa_train.models import meta_model

    cfg = compose(args)
    assert count_trainable(meta_model(cfg.model, cfg.attention), cfg.model.lora)[0] == \
        sum(p.numel() for p in model.parameters() if p.requires_grad) == trainer.n_trainable
    trainer.train()
    for n, p in model.named_parameters():
        assert torch.equal(before[n], p.detach()) != (n in trainable), n  # only what trains changed
    # the checkpoint holds the trainable tensors only
    step = tmp_path / "checkpoints" / "step_000003" / "ds" / "mp_rank_00_model_states.pt"
    saved = torch.load(step, map_location="cpu", weights_only=False)["module"]
    assert {k[len("lm."):] for k in saved} == trainable
    # the export is a plain model, W + (alpha / r) B A merged, that computes what the adapters did
    merged = load_pretrained(str(tmp_path / "hf"))
    assert not any("lora" in n for n, _ in merged.named_parameters())
    x = torch.randint(0, 200, (1, 96))
    model.eval()
    with torch.no_grad():
        a, b = model(input_ids=x).logits.float(), merged(input_ids=x).logits.float()
    assert ((a - b).norm() / a.norm()).item() < 1e-5
    # and it generates the same tokens through the NSA KV-cache path
    with torch.no_grad():
        ga = model.generate(x[:, :40], max_new_tokens=6, do_sample=False)
        gb = merged.generate(x[:, :40], max_new_tokens=6, do_sample=False)
    assert torch.equal(ga, gb)


@pytest.mark.parametrize("zero", [0, 2])
def test_lora_resume_is_exact_and_eval_only_reads_the_adapters(zero, tmp_path):
    straight = tmp_path / "straight"
    common = ["train.steps=4", "data.eval_fraction=0.1", f"parallel.zero_stage={zero}"]
    _, full = train(_args(straight, *common))
    split = tmp_path / "split"
    train(_args(split, *common, "train.save_every=2"), stop_after=2)
    _, rest = train(_args(split, *common, "train.save_every=2", "train.resume=auto"))
    losses = [r["loss"] for r in full if "loss" in r and "eval_loss" not in r]
    resumed = [r["loss"] for r in read_metrics(split) if "loss" in r and "eval_loss" not in r]
    assert len(resumed) == len(losses) == 4
    for a, b in zip(losses, resumed):  # as the other resume tests: CPU float noise only
        assert b == pytest.approx(a, abs=1e-6)
    last_eval = [r for r in full if "eval_loss" in r][-1]
    again = _trainer(_args(straight, *common, "eval.only=true", "train.resume=auto")).run()
    assert again["eval_loss"] == pytest.approx(last_eval["eval_loss"], rel=1e-6)


@pytest.mark.parametrize("nsa", ["lora", "freeze"])
def test_lora_nsa_options(nsa, tmp_path):
    trainer = _trainer(_args(tmp_path, "train.steps=1", f"model.lora.nsa={nsa}"))
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    gate_adapters = [n for n in trainable if ".nsa.gate.lora_" in n]
    phi = [n for n in trainable if ".nsa.compress_" in n]
    if nsa == "lora":  # the gate under adapters (its base frozen), phi fully trained
        assert gate_adapters and phi and not any(".nsa.gate.base_layer." in n for n in trainable)
    else:
        assert not gate_adapters and not phi and not any(".nsa." in n for n in trainable)
    # the gate is called as a module: its adapter changes the gates
    gate = trainer.model.model.layers[0].self_attn.nsa.gate
    if nsa == "lora":
        with torch.no_grad():
            gate.lora_B["default"].weight.fill_(0.5)
        h = torch.randn(1, 8, gate.in_features)
        assert not torch.allclose(gate(h), gate.base_layer(h))


def test_merged_state_dict_adds_the_scaled_low_rank_product():
    from msa_train.config import LoraConfig
    from msa_train.models.lora import merged_state_dict

    w, a, b = torch.randn(6, 5), torch.randn(2, 5), torch.randn(6, 2)
    state = {"l.q_proj.base_layer.weight": w, "l.q_proj.lora_A.default.weight": a,
             "l.q_proj.lora_B.default.weight": b, "l.norm.weight": torch.ones(5)}
    out = merged_state_dict(state, LoraConfig(r=2, alpha=3.0))
    assert set(out) == {"l.q_proj.weight", "l.norm.weight"}
    torch.testing.assert_close(out["l.q_proj.weight"], w + 1.5 * b @ a)


@pytest.mark.parametrize("override, match", [
    ("model.lora.r=-1", "model.lora.r"),
    ("model.lora.alpha=0", "model.lora.alpha"),
    ("model.lora.dropout=1.0", "model.lora.dropout"),
    ("model.lora.nsa=half", "model.lora.nsa"),
    ("model.lora.target_modules=[]", "model.lora.target_modules is empty"),
    ("model.lora.nsa=freeze model.nsa_init=distill", "could not be resumed"),
    ("model.lora.nsa=lora model.nsa_init=distill", "could not be resumed"),
    ("model.lora.target_modules=[q_proj,lm_head]", "cannot get adapters"),
])
def test_lora_config_errors(override, match):
    with pytest.raises(ValueError, match=match):
        compose(["model.lora.r=4", *override.split()])


def test_eval_only_of_a_lora_checkpoint_without_model_path_needs_the_training_seed(tmp_path):
    """The checkpoint holds the adapters only; the frozen base of a model built from hf_config comes
    from train.seed, so another seed would evaluate other weights."""
    args = _args(tmp_path, "train.steps=2", "data.eval_fraction=0.1")
    train(args)
    with pytest.raises(ValueError, match=r"eval.only: .*train.seed: 0 -> 1"):
        _trainer([*args, "eval.only=true", "train.resume=auto", "train.seed=1"])


def test_the_fused_mlp_runs_under_lora_adapters():
    """peft's LoRA layer wraps the MLP's projections; the fused SwiGLU still applies, and calls them
    (adapters included) as modules."""
    from msa_train.models.fused_ops import _fused_mlp_forward, _is_swiglu_mlp
    from msa_train.models.lora import apply_lora

    trainer_model = compose(["model.lora.r=2", "attention=full"])
    from msa_train.models import build_model

    model = build_model(trainer_model.model, trainer_model.attention)
    apply_lora(model, trainer_model.model.lora, torch.float32)
    mlp = model.model.layers[0].mlp
    assert _is_swiglu_mlp(mlp)
    with torch.no_grad():
        mlp.up_proj.lora_B["default"].weight.fill_(0.3)
    x = torch.randn(1, 5, mlp.gate_proj.in_features)
    torch.testing.assert_close(_fused_mlp_forward(mlp, x), mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)))


def test_lora_target_modules_that_match_nothing_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"no linear layer of the model has these names.*q_proj"):
        _trainer(_args(tmp_path, "model.lora.target_modules=[query,value]"))


def test_the_planner_counts_optimizer_state_for_the_trainable_parameters_only(tmp_path):
    from msa_train.parallel.planner import plan_of_config

    base = ["recipe=llama3_8b_64k", "attention=fmsa", f"data.path={tmp_path}/x.jsonl", "train.plan_world_size=1"]
    full = plan_of_config(compose(base))
    lora = plan_of_config(compose([*base, "model.lora.r=16"]))
    p = lambda plan, part: plan.parts[part]  # noqa: E731
    assert p(lora, "parameters") > p(full, "parameters")  # the adapters are added
    # Llama-3-8B: 12 bytes of optimizer state per trainable parameter; r=16 on the 7 projections of
    # 32 layers is 42M adapter parameters, NSA's own 292M: a 25th of 8.3B
    assert p(lora, "optimizer_state") < p(full, "optimizer_state") / 20
    assert lora.peak_gb < full.peak_gb - 90
    json.dumps(lora.to_dict())


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [["parallel.zero_stage=3"], ["parallel.sp_degree=2"]], ids=["zero3", "sp2"])
def test_lora_two_processes_match_one_process(parallel, tmp_path):
    """2 ranks (ZeRO-3: each its own sequences; SP: one sequence split across both) follow one
    process; the ZeRO-3 run's merged export equals the one-process run's."""
    from safetensors.torch import load_file

    from tests.msa_train._util import run_cli, torchrun_launcher

    common = [a for a in _args(tmp_path, "train.steps=3", "train.save_hf=true", *parallel)
              if not a.startswith("train.output_dir")]
    zero3 = parallel[0].startswith("parallel.zero_stage")
    one_args = [a for a in common if not a.startswith("parallel.sp_degree")]
    _, one = train([*one_args, *(["train.grad_accum=2"] if zero3 else []), f"train.output_dir={tmp_path / 'one'}"])
    launcher = torchrun_launcher(2)
    out = run_cli([*common, f"train.output_dir={tmp_path / 'two'}"], launcher=launcher, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    two = read_metrics(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a["step"], a["loss"], b["loss"])
    if zero3:
        w1, w2 = load_file(str(tmp_path / "one" / "hf" / "model.safetensors")), \
            load_file(str(tmp_path / "two" / "hf" / "model.safetensors"))
        assert set(w1) == set(w2) and not any("lora" in k for k in w2)
        for k in w1:
            torch.testing.assert_close(w2[k], w1[k], rtol=1e-3, atol=1e-4)
