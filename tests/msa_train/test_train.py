"""The trainer end to end on CPU: real HF models, real DeepSpeed, the real data pipeline."""
import json
import re
import signal

import pytest
import torch

from tests.msa_train._util import FAST, compose, read_metrics, run_cli, torchrun_launcher, train


@pytest.mark.parametrize("attention", ["full", "nsa"])
def test_tiny_recipe_trains_20_steps_with_loss_decreasing(tmp_path, attention):
    # (20 steps: the mean loss of the last three was 2.2 below the first three's with NSA, 1.0 needed)
    overrides = [f"attention={attention}", "train.steps=20", f"train.output_dir={tmp_path}", *FAST]
    if attention == "full":
        overrides += ["logger=wandb"]  # offline: needs no account
    summary, records = train(overrides)
    losses = [r["loss"] for r in records]
    assert [r["step"] for r in records] == list(range(1, 21))
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 1.0, f"loss did not decrease enough: {first:.3f} -> {last:.3f}"
    for key in ("loss", "tokens_per_s", "mfu", "peak_memory_gb", "lr", "grad_norm"):
        assert key in records[0]
    assert all(r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and r["lr"] > 0 for r in records)
    assert summary["steps"] == 20 and summary["final_loss"] == losses[-1]
    assert json.loads((tmp_path / "summary.json").read_text())["attention"] == attention
    startup = summary["startup_s"]  # each build step's seconds, in the order they ran
    assert list(startup) == ["distributed", "data", "model", "parallelize", "optimizer", "checkpoint", "logger"]
    assert all(v >= 0 for v in startup.values()) and startup["model"] > 0
    assert (tmp_path / "config.json").is_file() and (tmp_path / "deepspeed_config.json").is_file()
    assert (tmp_path / "checkpoints" / "step_000020" / "COMPLETE").is_file()
    if attention == "full":
        assert list((tmp_path / "wandb").glob("offline-run-*")), "wandb offline run not written"


def test_resume_reproduces_the_uninterrupted_loss_curve(tmp_path):
    common = ["attention=full", "train.steps=8", "train.grad_accum=2", "train.save_every=0", *FAST]
    _, full = train([*common, f"train.output_dir={tmp_path / 'a'}"])
    _, first = train([*common, f"train.output_dir={tmp_path / 'b'}"], stop_after=4)
    assert [r["step"] for r in first] == [1, 2, 3, 4]
    summary, resumed = train([*common, f"train.output_dir={tmp_path / 'b'}", "train.resume=auto"])
    assert summary["resumed_from"].endswith("step_000004")
    assert [r["step"] for r in resumed] == list(range(1, 9))  # metrics.jsonl reads as one run
    for a, b in zip(full, resumed):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6), (a["step"], a["loss"], b["loss"])
        assert a["lr"] == pytest.approx(b["lr"], abs=1e-12)


def test_phase_times_split_each_logged_interval(tmp_path):
    common = ["attention=full", "train.steps=4", "train.grad_accum=2", "train.log_every=2", "train.save_final=false", *FAST]
    _, records = train([*common, "train.phase_times=true", f"train.output_dir={tmp_path / 'a'}"])
    assert [r["step"] for r in records] == [2, 4]
    previous = 0.0
    for r in records:
        phases = [r["forward_s"], r["backward_s"], r["step_s"]]
        assert all(p > 0 for p in phases), r
        interval = r["elapsed_s"] - previous  # two steps of 2 micro steps each, plus the loop's own work
        assert sum(phases) <= interval, (phases, interval)
        previous = r["elapsed_s"]
    _, plain = train([*common, f"train.output_dir={tmp_path / 'b'}"])
    assert not {"forward_s", "backward_s", "step_s"} & set(plain[0])
    assert [r["loss"] for r in plain] == [r["loss"] for r in records]  # timing changes nothing computed


def test_resume_refuses_a_checkpoint_of_a_differently_configured_run(tmp_path):
    common = ["attention=full", "train.steps=4", "train.save_every=2", f"train.output_dir={tmp_path}", *FAST]
    train(common, stop_after=2)
    with pytest.raises(ValueError, match=r"train.resume: .*train.seq_len: 512 -> 256"):
        train([*common, "train.resume=auto", "train.seq_len=256"])
    summary, _ = train([*common, "train.resume=auto", "train.steps=5"])  # more steps: allowed
    assert summary["resumed_from"].endswith("step_000002") and summary["steps"] == 5


def test_sigkill_during_checkpoint_write_leaves_previous_checkpoint_usable(tmp_path):
    args = ["attention=full", "train.steps=6", "train.save_every=3", f"train.output_dir={tmp_path}", *FAST]
    out = run_cli(args, faults=["sigkill-in-save=6"])
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "step_000003" / "COMPLETE").is_file()
    assert (ckpts / ".tmp_step_000006").is_dir() and not (ckpts / "step_000006").exists()
    summary, records = train([*args, "train.resume=auto"])
    assert summary["resumed_from"].endswith("step_000003") and summary["steps"] == 6
    assert [r["step"] for r in records] == list(range(1, 7))
    assert (ckpts / "step_000006" / "COMPLETE").is_file() and not (ckpts / ".tmp_step_000006").exists()


def test_bare_command_runs_the_tiny_recipe(tmp_path):
    """``msa-train`` with only a shorter run and a temp output dir: the tiny recipe with NSA."""
    out = run_cli(["train.steps=3", f"train.output_dir={tmp_path}", "data.num_docs=48"])
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["recipe"] == "tiny" and summary["attention"] == "auto" and summary["steps"] == 3
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "model.safetensors").is_file()
    assert len(read_metrics(tmp_path)) == 3


def test_finetune_saved_model_on_user_jsonl(tmp_path):
    """The README's second step: start from a trained HF dir (model.path) on your own jsonl."""
    from safetensors.torch import load_file

    from msa_train.trainer import Trainer
    from tests.msa_train._util import compose

    train(["train.steps=2", f"train.output_dir={tmp_path / 'pre'}", "data.num_docs=48",
           "train.progress=false", "train.save_hf=true"])
    hf = tmp_path / "pre" / "hf"
    docs = tmp_path / "docs.jsonl"
    words = "the quick brown fox jumps over the lazy dog while the long document goes on".split()
    docs.write_text("".join(json.dumps({"text": " ".join(words[(i + j) % len(words)] for j in range(300))}) + "\n"
                            for i in range(24)))
    trainer = Trainer(compose(["data=jsonl", f"data.path={docs}", f"model.path={hf}", "train.steps=2",
                               f"train.output_dir={tmp_path / 'ft'}", "train.progress=false", "train.save_hf=false"]))
    saved = load_file(str(hf / "model.safetensors"))
    params = dict(trainer.model.named_parameters())
    assert any(".nsa." in k for k in saved)
    for name, tensor in saved.items():  # HF and NSA weights both start from the saved model
        assert torch.equal(params[name].detach().cpu(), tensor), name  # (on the GPU there)
    summary = trainer.train()
    assert summary["steps"] == 2 and summary["final_loss"] is not None


def test_activation_checkpointing_gives_the_same_losses(tmp_path):
    """HF layer checkpointing re-runs every NSA attention in the backward (with the hidden-state hook),
    and training follows the plain run. Not bitwise: on one CI machine a recomputed layer rounded
    differently and the step-2 loss moved by one ulp. The gradients themselves are compared with
    and without checkpointing in test_memory's patched-model test."""
    from msa_train.trainer import Trainer

    common = ["train.steps=3", "train.seq_len=256", *FAST]
    _, plain = train([*common, f"train.output_dir={tmp_path / 'a'}"])
    trainer = Trainer(compose([*common, "parallel.activation_checkpointing=true", f"train.output_dir={tmp_path / 'b'}"]))
    attention = [m for m in trainer.model.modules() if hasattr(m, "nsa")]
    calls = []
    for m in attention:
        m.register_forward_pre_hook(lambda *_: calls.append(1))
    trainer.train()
    ckpt = read_metrics(tmp_path / "b")
    assert attention and len(calls) == 2 * 3 * len(attention)  # forward + recompute, each step
    for a, b in zip(plain, ckpt, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("procs", [1, 2])
def test_stop_signal_checkpoints_the_current_step_and_resumes(tmp_path, procs):
    """A SIGTERM (here sent by the last rank to itself at the end of step 2: a patched-in fault) stops
    every rank after that step with a complete checkpoint there, and the process exits 0;
    resume=auto continues from it."""
    args = ["attention=full", "train.steps=6", "train.seq_len=256", f"train.output_dir={tmp_path}", *FAST]
    if procs == 1:
        args.append("logger=wandb")  # offline: the resume continues the same wandb run
    launcher = ()
    if procs > 1:
        launcher = torchrun_launcher(procs)
    out = run_cli(args, faults=[f"sigterm-at=2:{procs - 1}"], launcher=launcher, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "stop signal: stopped after step 2" in out.stdout + out.stderr
    ckpt = tmp_path / "checkpoints" / "step_000002"
    assert (ckpt / "COMPLETE").is_file() and all((ckpt / f"rank_{r:05d}.pt").is_file() for r in range(procs))
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    if procs == 1:
        summary, records = train([*args, "train.resume=auto"])
        assert summary["resumed_from"].endswith("step_000002") and summary["steps"] == 6
        assert [r["step"] for r in records] == list(range(1, 7)) and summary["stopped_by_signal"] is None
        runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
        # offline-run-<date>_<time>-<run id>, where wandb adds "-1" when both runs started in the same second
        ids = {re.fullmatch(r"offline-run-\d{8}_\d{6}-([a-z0-9]+)(-\d+)?", r.name).group(1) for r in runs}
        assert len(runs) == 2 and len(ids) == 1, runs


def test_document_tokens_per_s_leaves_the_padding_out(tmp_path):
    """tokens_per_s counts the positions computed (padding included, as MFU does);
    document_tokens_per_s the document tokens of the same steps."""
    from msa_train.trainer import Trainer
    from tests.msa_train._util import compose, read_metrics

    cfg = compose(["attention=full", "train.steps=4", "train.grad_accum=2", "train.log_every=1",
                   "train.save_every=0", "train.save_final=false", f"train.output_dir={tmp_path}", *FAST])
    trainer = Trainer(cfg)
    assert trainer.dataset.padding_fraction > 0  # else the test could not tell the two apart
    seen, next_batch = [], trainer._next_batch
    trainer._next_batch = lambda: seen.append(next_batch()) or seen[-1]
    summary = trainer.train()
    records = read_metrics(tmp_path)
    assert len(records) == 4 and len(seen) == 8
    for i, r in enumerate(records):
        documents = sum(m["num_tokens"] for m in seen[2 * i:2 * i + 2])
        assert r["document_tokens_per_s"] / r["tokens_per_s"] == pytest.approx(documents / (2 * 512), rel=1e-9)
        # the tokens the loss averaged: every label that is not masked (the targets, shifted)
        assert r["label_tokens"] == sum(int((m["targets"] != -100).sum()) for m in seen[2 * i:2 * i + 2])
    assert any(r["document_tokens_per_s"] < r["tokens_per_s"] for r in records)
    assert summary["mean_document_tokens_per_s"] < summary["mean_tokens_per_s"]


@pytest.mark.parametrize("stage, recipe", [(0, "tiny"), (3, "tiny"), (0, "tiny_qwen3"), (3, "tiny_qwen3")],
                         ids=["zero0", "zero3", "zero0-tied", "zero3-tied"])
def test_fused_loss_trains_like_the_recomputed_one(tmp_path, stage, recipe):
    """train.loss_impl: the fused linear cross-entropy (gradients in the forward; under ZeRO-3 run as
    the head's forward so its weight is gathered) follows the recomputed form's losses, also with the
    head tied to the embedding (tiny_qwen3), whose gradient then adds both uses."""
    common = [f"recipe={recipe}", "train.steps=3", "train.seq_len=256", f"parallel.zero_stage={stage}", *FAST]
    _, fused = train([*common, f"train.output_dir={tmp_path / 'a'}"])
    _, recomputed = train([*common, "train.loss_impl=recompute", f"train.output_dir={tmp_path / 'b'}"])
    # On CUDA the trainer runs in bf16, where the two forms round differently (the fused kernel's
    # fp32 softmax over the bf16 logits): the losses after the first step were up to 4.2e-5 apart
    # on the H200 (benchmarks/results/gpu_tests/runs.md#gpu_tests_train). The CPU bound stays 1e-5.
    rel = 1e-4 if torch.cuda.is_available() else 1e-5
    assert [r["loss"] for r in fused] == pytest.approx([r["loss"] for r in recomputed], rel=rel)
    assert fused[-1]["loss"] < fused[0]["loss"] - 0.1


def test_a_checkpoint_from_before_loss_impl_resumes_only_with_the_recomputed_loss():
    from msa_train.trainer import check_resume_config

    saved = {"train": {"seq_len": 512, "loss_chunk_tokens": 4096}}  # written before train.loss_impl existed
    check_resume_config(saved, {"train": {"seq_len": 512, "loss_chunk_tokens": 4096, "loss_impl": "recompute"}}, "ck")
    with pytest.raises(ValueError, match=r"train.loss_impl: 'recompute' -> 'fused'"):
        check_resume_config(saved, {"train": {"seq_len": 512, "loss_chunk_tokens": 4096, "loss_impl": "fused"}}, "ck")


def test_a_profiled_step_inside_a_logged_interval_flags_its_record(tmp_path):
    common = ["attention=full", "train.steps=4", "train.log_every=2", "train.save_final=false", *FAST]
    summary, records = train([*common, "train.profile_step=1", f"train.output_dir={tmp_path}"])
    assert [(r["step"], r.get("profiled", False)) for r in records] == [(2, True), (4, False)]
    assert (tmp_path / "profile_step1.md").is_file()
    assert summary["mean_tokens_per_s"] == records[1]["tokens_per_s"]


@pytest.mark.parametrize("stage", [0, 2])
def test_model_is_built_on_its_training_device(tmp_path, stage, monkeypatch):
    """Under ZeRO 0-2 the weights (the HF model's and the NSA modules') are created on the training
    device, not initialised on the host and copied there by the engine. (On a CPU the device is the
    host: the test means most on CUDA.)"""
    from msa_train.trainer import Trainer

    seen = {}
    build = Trainer._build_parallelize

    def record(self):  # before the engine, which would move the model anyway
        seen["devices"], seen["want"] = {p.device.type for p in self.model.parameters()}, self.device.type
        build(self)

    monkeypatch.setattr(Trainer, "_build_parallelize", record)
    Trainer(compose(["attention=nsa", "train.steps=1", "train.seq_len=128", f"parallel.zero_stage={stage}",
                     f"train.output_dir={tmp_path}", *FAST]))
    assert seen["devices"] == {seen["want"]}, seen


def test_deterministic_setting_reaches_the_nsa_op(tmp_path, monkeypatch):
    """train.deterministic=true reaches flash_msa.nsa_attention as deterministic=True (compressed
    attention kept off cuDNN, whose dq is not deterministic); attention=nsa is the query-centric
    loop order ("qc") end to end."""
    import flash_msa.nsa as fnsa
    from msa_train.trainer import Trainer

    seen = []
    real = fnsa.nsa_attention
    monkeypatch.setattr(fnsa, "nsa_attention", lambda *a, **kw: seen.append(kw["deterministic"]) or real(*a, **kw))
    trainer = Trainer(compose(["attention=nsa", "train.deterministic=true", "train.steps=1", "train.seq_len=128",
                               f"train.output_dir={tmp_path}", *FAST]))
    modules = [m.nsa for m in trainer.model.modules() if hasattr(m, "nsa")]
    assert modules and all(m.deterministic and m.requested_impl == "qc" for m in modules)
    m = modules[0]
    H, HK, D = m.num_heads, m.num_kv_heads, m.head_dim
    x = torch.randn(1, 64, m.gate.in_features)
    q, k, v = torch.randn(1, 64, H, D), torch.randn(1, 64, HK, D), torch.randn(1, 64, HK, D)
    m.impl = "reference"
    m(x.to(m.gate.weight.dtype), *(t.to(m.gate.weight.dtype) for t in (q, k, v)))
    assert seen == [True]
