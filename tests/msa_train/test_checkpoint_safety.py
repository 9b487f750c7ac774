"""What resume does with checkpoints that are corrupt, truncated, inconsistent or crafted, and what
a run does when training goes non-finite (docs/trainer.md, Failure model)."""
import json
import logging
import math
import pathlib
import re
import shutil
from types import SimpleNamespace

import pytest
import torch

from msa_train.checkpoint import MANIFEST, CheckpointError, CheckpointManager, file_digests
from tests.msa_train._util import FAST, compose, read_metrics, run_cli, train

# ZeRO-2: DeepSpeed writes its model states and, apart, its optimizer states
SMALL = ["attention=full", "train.seq_len=128", "parallel.zero_stage=2", "train.save_every=1", *FAST]


class Marker:
    """A crafted pickle: unpickling it writes ``path``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return pathlib.Path.write_text, (pathlib.Path(self.path), "code ran")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step run with checkpoints at steps 1 and 2, and its trainer (its engine loads checkpoints)."""
    from msa_train.trainer import Trainer

    out = tmp_path_factory.mktemp("run")
    trainer = Trainer(compose([*SMALL, "train.steps=2", f"train.output_dir={out}"]))
    trainer.train()
    return trainer, out / "checkpoints"


@pytest.fixture
def ckpts(trained, tmp_path):
    root = tmp_path / "checkpoints"
    shutil.copytree(trained[1], root)
    return root


def _refresh_manifest(step_dir, *files):
    """Make the manifest agree with ``files`` as they are now (what someone rewriting a file can do too)."""
    manifest = json.loads((step_dir / MANIFEST).read_text())
    for f in files:
        rel = str(f.relative_to(step_dir))
        manifest["files"][rel] = {"size": f.stat().st_size, "sha256": file_digests(step_dir, [rel])[rel]}
    (step_dir / MANIFEST).write_text(json.dumps(manifest))


def _plant(path, marker):
    state = torch.load(path, weights_only=False)
    state["extra"] = Marker(marker)
    torch.save(state, path)


@pytest.mark.parametrize("name", ["rank_00000.pt", "ds/mp_rank_00_model_states.pt",
                                  "ds/zero_pp_rank_0_mp_rank_00_optim_states.pt"],
                         ids=["rank-state", "model-states", "optim-states"])
def test_a_crafted_pickle_in_any_checkpoint_file_does_not_run(trained, ckpts, tmp_path, name):
    """Planted in the file (and the manifest updated to match, as whoever planted it could): resuming
    refuses the file by name, in the verification and in DeepSpeed's own load, and runs nothing."""
    trainer, _ = trained
    step = ckpts / "step_000002"
    marker = tmp_path / "marker"
    _plant(step / name, marker)
    _refresh_manifest(step, step / name)
    mgr = CheckpointManager(ckpts, rank=0)
    with pytest.raises(CheckpointError, match=rf"train.resume=.*{name}: refused to load: it holds more than tensors"):
        mgr.resolve(str(step))
    with pytest.raises(CheckpointError, match=rf"{name}: refused to load"):  # the loaders themselves, unverified
        mgr.load(trainer.engine, step)
    assert not marker.exists()
    assert mgr.resolve("auto") == ckpts / "step_000001"  # resume=auto goes back to the one that verifies
    assert (ckpts / "corrupt_step_000002").is_dir() and not marker.exists()


def test_a_crafted_dpo_reference_does_not_run(tmp_path):
    from msa_train.trainer import Trainer

    path = tmp_path / "dpo_reference" / "rank_00000.pt"
    path.parent.mkdir()
    torch.save({0: [1.0, 2.0], "eval": Marker(tmp_path / "marker")}, path)
    fake = SimpleNamespace(cfg=SimpleNamespace(train=None), run_dir=tmp_path, resumed_from="ckpt",
                           dist=SimpleNamespace(rank=0))
    with pytest.raises(CheckpointError, match=r"dpo_reference/rank_00000.pt: refused to load"):
        Trainer._build_reference(fake)
    assert not (tmp_path / "marker").exists()


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _copy_ds_of_step_1(step):
    shutil.rmtree(step / "ds")
    shutil.copytree(step.with_name("step_000001") / "ds", step / "ds")


MODEL = "ds/mp_rank_00_model_states.pt"
CORRUPTIONS = {  # what is done to step 2, what verification says about it
    "bit-flip": (lambda s: _flip_byte(s / MODEL), rf"{MODEL} does not match its sha256"),
    "ds-of-step-1": (_copy_ds_of_step_1, r"ds/.* does not match its sha256"),
    "ds-of-step-1-manifest-rewritten": (
        lambda s: (_copy_ds_of_step_1(s), _refresh_manifest(s, *(s / "ds").iterdir())),
        rf"{MODEL} holds DeepSpeed's state of step 1, the checkpoint is of step 2"),
    "truncated": (lambda s: _truncate(s / MODEL), rf"{MODEL} has \d+ bytes, the manifest \d+ \(truncated"),
    "truncated-manifest-rewritten": (lambda s: (_truncate(s / MODEL), _refresh_manifest(s, s / MODEL)),
                                     rf"{MODEL}: cannot be read, truncated or corrupt"),
    "model-states-deleted": (lambda s: (s / MODEL).unlink(), rf"{MODEL} is missing"),
    "extra-file": (lambda s: shutil.copy(s / MODEL, s / "ds/mp_rank_01_model_states.pt"),
                   r"ds/mp_rank_01_model_states.pt is not in the manifest"),
    "only-complete": (lambda s: (shutil.rmtree(s), s.mkdir(), (s / "COMPLETE").write_text("2\n")),
                      rf"{MANIFEST} is missing"),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_damaged_checkpoint_is_named_and_resume_auto_falls_back(ckpts, corruption, caplog):
    damage, says = CORRUPTIONS[corruption]
    step = ckpts / "step_000002"
    damage(step)
    mgr = CheckpointManager(ckpts, rank=0)
    with pytest.raises(CheckpointError, match=says):  # an explicit path raises
        mgr.resolve(str(step))
    with caplog.at_level(logging.WARNING, logger="msa_train.checkpoint"):
        assert mgr.resolve("auto") == ckpts / "step_000001"
    assert re.search(rf"skipping .*step_000002, which does not verify \(.*{says}", caplog.text), caplog.text
    assert not step.exists() and (ckpts / "corrupt_step_000002").is_dir()  # set aside, kept


def test_resume_auto_raises_when_no_checkpoint_verifies(ckpts):
    for step in ("step_000001", "step_000002"):
        _flip_byte(ckpts / step / MODEL)
    with pytest.raises(CheckpointError, match=r"no checkpoint under .* verifies.*step_000002: .*step_000001: "):
        CheckpointManager(ckpts, rank=0).resolve("auto")


def test_resume_auto_trains_on_from_the_last_checkpoint_that_verifies(trained, tmp_path):
    """End to end: the newest checkpoint bit-flipped, the run resumes the previous one, re-trains the
    step and saves it anew (the corrupt one set aside does not block it)."""
    shutil.copytree(trained[1], tmp_path / "checkpoints")
    _flip_byte(tmp_path / "checkpoints" / "step_000002" / MODEL)
    summary, _ = train([*SMALL, "train.steps=2", f"train.output_dir={tmp_path}", "train.resume=auto"])
    assert summary["resumed_from"].endswith("step_000001") and summary["steps"] == 2
    CheckpointManager(tmp_path / "checkpoints", rank=0).verify(tmp_path / "checkpoints" / "step_000002")


# ------------------------------------------------------------------ non-finite values

def _strict_json(line):
    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")
    return json.loads(line, parse_constant=refuse)


def test_a_run_into_nan_exits_non_zero_and_keeps_only_finite_checkpoints(tmp_path):
    """lr 20 on the tiny recipe: the gradient norm is NaN at step 3 (loss 2e4 at step 2)."""
    args = [*SMALL, "parallel.zero_stage=0", "train.steps=8", "train.lr=20", "train.warmup_steps=2",
            "train.save_hf=true", f"train.output_dir={tmp_path}"]
    out = run_cli(args)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert re.search(r"msa-train: error: train.on_nonfinite=stop: at step 3 grad_norm=nan not finite.*"
                     r"the last checkpoint, .*step_000002, is finite", out.stderr), out.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    assert not (tmp_path / "hf").exists()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [_strict_json(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["grad_norm"] is None


@pytest.fixture
def nan_from(monkeypatch):
    """``nan_from(step, times)``: the loss of the micro steps of ``step`` is NaN the first ``times``
    times that step runs (None: every time, and every later step too)."""
    from msa_train.trainer import Trainer

    forward, seen = Trainer._forward, []

    def install(step, times=None):
        def nan_forward(self, m, **kwargs):
            out = forward(self, m, **kwargs)
            now = self.step + 1
            if self.module.training and (now >= step if times is None else now == step):
                seen.append(now)
                if times is None or seen.count(now) <= times:
                    return out * float("nan")
            return out
        monkeypatch.setattr(Trainer, "_forward", nan_forward)
    return install


def test_skip_restores_the_last_checkpoint_and_skips_the_batches_since(tmp_path, nan_from):
    nan_from(3, times=1)
    args = [*SMALL, "parallel.zero_stage=0", "train.steps=4", "train.on_nonfinite=skip", "train.save_hf=true",
            f"train.output_dir={tmp_path}"]
    summary, records = train(args)
    assert summary["steps"] == 4 and math.isfinite(summary["final_loss"])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [_strict_json(line)["step"] for line in lines] == [1, 2, 2, 3, 4]
    skip = records[2]["nonfinite_skip"]
    assert skip == {"at_step": 3, "values": ["loss=nan", "grad_norm=nan"], "restored": "step_000002",
                    "skipped_steps": [3, 3]}
    # the step re-ran on the next batch: a plain run's step 3 saw another one
    _, plain = train([*args, "train.on_nonfinite=stop", f"train.output_dir={tmp_path / 'plain'}"])
    assert records[3]["loss"] != plain[2]["loss"] and records[1]["loss"] == plain[1]["loss"]
    from safetensors.torch import load_file
    assert all(torch.isfinite(t).all() for t in load_file(str(tmp_path / "hf" / "model.safetensors")).values())


def test_skip_stops_when_the_restored_checkpoint_goes_non_finite_again(tmp_path, nan_from):
    from msa_train.trainer import NonFiniteError

    nan_from(3)
    with pytest.raises(NonFiniteError, match=r"skip: at step 3 loss=nan, grad_norm=nan not finite again after "
                                             r"restoring it; .*step_000002, is finite"):
        train([*SMALL, "parallel.zero_stage=0", "train.steps=4", "train.on_nonfinite=skip",
               f"train.output_dir={tmp_path}"])
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001", "step_000002"]


def test_a_non_finite_state_between_logs_is_caught_before_the_save(tmp_path, nan_from):
    """With train.log_every past the save, the check at the save (a sync point anyway) catches it."""
    from msa_train.trainer import NonFiniteError

    nan_from(2)
    with pytest.raises(NonFiniteError, match=r"stop: at step 3 loss, grad_norm, weights not finite; .*no checkpoint "
                                             r"was written yet"):
        train([*SMALL, "parallel.zero_stage=0", "train.steps=4", "train.log_every=4", "train.save_every=3",
               "train.save_hf=true", f"train.output_dir={tmp_path}"])
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "hf").exists()


def test_metrics_jsonl_stays_strict_json_with_non_finite_values(tmp_path):
    from msa_train.config import LoggerConfig
    from msa_train.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, LoggerConfig(), total_steps=2, start_step=0, enabled=True, progress=False,
                           config_dict={})
    logger.log({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "tokens_per_s": 1.0,
                "peak_memory_gb": 0.0, "nested": [float("-inf"), 2.0]})
    logger.close({"final_loss": float("nan")})
    assert _strict_json((tmp_path / "metrics.jsonl").read_text()) == {
        "step": 1, "loss": None, "grad_norm": None, "tokens_per_s": 1.0, "peak_memory_gb": 0.0, "nested": [None, 2.0]}
    assert _strict_json((tmp_path / "summary.json").read_text()) == {"final_loss": None}


def test_eval_only_under_zero3_reads_the_weights_safely(tmp_path, monkeypatch):
    """ZeRO-3 keeps the weights in the optimizer's partitions: eval.only restores them from there, not
    through DeepSpeed's zero_to_fp32 (which unpickles every rank's files with weights_only=False)."""
    import deepspeed.runtime.engine as ds_engine

    from msa_train.trainer import Trainer

    args = ["attention=full", "train.seq_len=128", "parallel.zero_stage=3", "train.steps=1", "data.eval_fraction=0.125", *FAST,
            f"train.output_dir={tmp_path}"]
    trained = Trainer(compose(args))
    trained.train()
    monkeypatch.setattr(ds_engine, "get_fp32_state_dict_from_zero_checkpoint",
                        lambda *a, **k: pytest.fail("zero_to_fp32 reads the checkpoint unsafely"))
    evaluated = Trainer(compose([*args, "eval.only=true", "train.resume=auto"]))
    for a, b in zip(trained.module.parameters(), evaluated.module.parameters(), strict=True):
        assert torch.equal(a.ds_tensor, b.ds_tensor)
    assert any(p.ds_tensor.abs().sum() > 0 for p in evaluated.module.parameters())
