"""ZeRO-3 with a part of the optimizer state on the GPU (``parallel.offload_ratio`` < 1): DeepSpeed
steps those sub-groups with a second optimizer whose state its own checkpoint leaves out and whose
learning rate its scheduler does not move; ours saves that state, so a resume is exact, and the
trainer passes it the rate before each step.

On a CPU DeepSpeed's accelerator is the CPU, so every sub-group counts as the host's and its second
optimizer never runs. The tests mark sub-groups as the GPU's after DeepSpeed builds them, as a GPU
run does (``subgroup_to_device``: only ``_optimizer_step`` reads it after construction), so the CPU
run steps them with that optimizer, as on a GPU. The partial offload needs DeepSpeed's cpu_adam,
which is compiled on first use (about 1.5 minutes on two cores)."""
import pytest
import torch
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from msa_train.checkpoint import CheckpointError
from msa_train.parallel import deepspeed_config
from msa_train.parallel.engine import gpu_share_optimizer
from tests.msa_train._util import FAST, compose, read_metrics

PARTIAL = ["attention=full", "train.seq_len=128", "parallel=zero3", "parallel.offload_optimizer=true",
           "parallel.optimizer=deepspeed", "parallel.offload_ratio=0.5", "train.warmup_steps=1", *FAST]


@pytest.fixture
def on_gpu(monkeypatch):
    """``on_gpu["share"]``: the fraction of the optimizer's sub-groups then stepped as the GPU's
    (DeepSpeed's backup optimizer), the first ones, as DeepSpeed assigns them."""
    built, setting = DeepSpeedZeroOptimizer_Stage3.__init__, {"share": 0.5}

    def init(self, *args, **kwargs):
        built(self, *args, **kwargs)
        if getattr(self, "backup_optimizer", None) is not None:
            for i in range(int(len(self.subgroup_to_device) * setting["share"])):
                self.subgroup_to_device[i] = "gpu"

    monkeypatch.setattr(DeepSpeedZeroOptimizer_Stage3, "__init__", init)
    # sub-groups of 1e5 elements: the tiny model's 1.15M parameters fill a dozen (one at 1e8)
    monkeypatch.setattr(deepspeed_config, "PARTIAL_OFFLOAD_SUB_GROUP", 100_000)
    return setting


def _trainer(args):
    from msa_train.trainer import Trainer

    return Trainer(compose(args))


@pytest.mark.slow
def test_a_partial_offload_resumes_exactly(tmp_path, on_gpu):
    whole = _trainer([*PARTIAL, "train.steps=4", "train.save_every=2", f"train.output_dir={tmp_path / 'a'}"])
    whole.train()
    records = [r for r in read_metrics(tmp_path / "a") if "loss" in r]
    losses = {r["step"]: r["loss"] for r in records}
    # the GPU share followed the schedule (DeepSpeed's scheduler sets only the host optimizer's rate)
    assert records[-1]["lr"] < records[0]["lr"]
    assert [g["lr"] for g in gpu_share_optimizer(whole.engine)[0].param_groups] == pytest.approx(
        [records[-1]["lr"]] * len(whole.engine.optimizer.param_groups))
    resumed = _trainer([*PARTIAL, "train.steps=4", f"train.output_dir={tmp_path / 'b'}",
                        f"train.resume={tmp_path / 'a' / 'checkpoints' / 'step_000002'}"])
    backup, params = gpu_share_optimizer(resumed.engine)
    assert params and all(p in backup.state for p in params.values())  # the GPU share's moments came back
    assert len(params) < len(resumed.engine.optimizer.fp32_partitioned_groups_flat)  # the host has its part
    resumed.train()
    again = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "b") if "loss" in r}
    assert again == {s: losses[s] for s in (3, 4)}, (again, losses)
    for a, b in zip(whole.module.parameters(), resumed.module.parameters(), strict=True):
        assert torch.equal(a.ds_tensor, b.ds_tensor)


@pytest.mark.slow
def test_a_checkpoint_of_another_split_is_refused_by_name(tmp_path, on_gpu):
    """Saved with every sub-group stepped on the host, resumed with half on the GPU: the GPU's
    moments would restart, so the resume stops and names the setting."""
    on_gpu["share"] = 0.0
    _trainer([*PARTIAL, "train.steps=2", f"train.output_dir={tmp_path}"]).train()
    on_gpu["share"] = 0.5
    with pytest.raises(CheckpointError, match="resume with the parallel.offload_ratio"):
        _trainer([*PARTIAL, "train.steps=3", f"train.output_dir={tmp_path}", "train.resume=auto"]).train()
