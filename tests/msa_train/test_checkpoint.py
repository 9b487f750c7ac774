"""CheckpointManager's guarantees without a model: a fake engine writes one file per save."""
import json
import logging
from pathlib import Path

import pytest
import torch

from msa_train.checkpoint import COMPLETE, CheckpointManager, complete_checkpoints
from msa_train.metrics import MetricsLogger
from tests.msa_train._util import FAST, train


class FakeEngine:
    def save_checkpoint(self, path, tag, save_latest=False, exclude_frozen_parameters=False):
        Path(path, tag).mkdir()
        torch.save({"w": torch.zeros(2)}, Path(path, tag, "model.pt"))


def _save(mgr, step):
    return mgr.save(FakeEngine(), step, {"step": step}, {"sampler": {}})


def test_pruning_keeps_the_checkpoint_just_written_and_newer_ones(tmp_path):
    mgr = CheckpointManager(tmp_path, rank=0, keep=1)
    _save(mgr, 5)
    _save(mgr, 3)  # e.g. another run in the same directory, stepping below the old checkpoint
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [3, 5]
    _save(mgr, 4)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [4, 5]
    assert not list(tmp_path.glob(".trash_*")) and not list(tmp_path.glob(".tmp_*"))


@pytest.mark.parametrize("rank, local_rank, flushes", [(0, 0, ["COMPLETE"]), (1, 0, ["rank"]), (1, 1, []),
                                                       (9, 0, ["rank"])], ids=["rank0", "node-first", "node-other",
                                                                               "node2-first"])
def test_every_node_flushes_its_files_before_the_checkpoint_is_marked(tmp_path, monkeypatch, rank, local_rank,
                                                                        flushes):
    """The first rank of each node fsyncs the step's files before the barrier after which rank 0
    writes COMPLETE (rank 0's own fsync covers only what its node wrote on a shared filesystem)."""
    import msa_train.checkpoint as ckpt

    seen = []
    monkeypatch.setattr(ckpt, "_fsync_tree", lambda root: seen.append(sorted(p.name for p in root.iterdir())))
    (tmp_path / ".tmp_step_000007").mkdir()  # rank 0 makes it before the first barrier
    _save(CheckpointManager(tmp_path, rank=rank, keep=2, local_rank=local_rank), 7)
    assert len(seen) == len(flushes)
    if flushes == ["rank"]:  # before the marker: the tree holds this rank's file and no COMPLETE yet
        assert f"rank_{rank:05d}.pt" in seen[0] and COMPLETE not in seen[0]


def test_resave_of_a_step_swaps_and_an_interrupted_swap_is_finished(tmp_path):
    mgr = CheckpointManager(tmp_path, rank=0, keep=2)
    _save(mgr, 3)
    final = _save(mgr, 3)  # the same step again (final == periodic)
    assert (final / COMPLETE).is_file() and (final / "ds" / "model.pt").is_file()
    assert not list(tmp_path.glob(".trash_*"))
    # a kill between the two renames: the old one already moved away, the new one complete in .tmp
    final.rename(tmp_path / ".tmp_step_000003")
    assert CheckpointManager(tmp_path, rank=0).resolve("auto") == final
    assert (final / COMPLETE).is_file()
    # an incomplete .tmp is left alone (and ignored)
    (tmp_path / ".tmp_step_000004").mkdir()
    assert CheckpointManager(tmp_path, rank=0).resolve("auto") == final


def test_check_no_newer_names_the_conflicting_checkpoints(tmp_path):
    mgr = CheckpointManager(tmp_path, rank=0, keep=0)
    _save(mgr, 2)
    _save(mgr, 4)
    mgr.check_no_newer(4, tmp_path / "step_000004")
    with pytest.raises(ValueError, match="starting a fresh run.*step_000002, step_000004.*train.resume=auto"):
        mgr.check_no_newer(0, None)
    with pytest.raises(ValueError, match=r"step 2\).*step_000004"):
        mgr.check_no_newer(2, tmp_path / "step_000002")


def test_fresh_run_over_an_old_runs_checkpoints_is_refused(tmp_path):
    common = ["attention=full", "train.steps=2", f"train.output_dir={tmp_path}", *FAST]
    train(common)
    with pytest.raises(ValueError, match="holds checkpoints of later steps.*starting a fresh run"):
        train([*common, "train.lr=1e-3"])
    with pytest.raises(ValueError, match=r"parallel\.zero_stage|zero_stage: 0 -> 2"):
        train([*common, "train.resume=auto", "parallel.zero_stage=2"])  # refused by name, before DeepSpeed reads it


def test_metrics_truncation_survives_a_cut_last_line(tmp_path):
    from msa_train.config import LoggerConfig

    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3)]
    path.write_text("\n".join(lines) + '\n{"step": 4, "loss": 4.1')  # a write cut short
    logger = MetricsLogger(tmp_path, LoggerConfig(), total_steps=10, start_step=2, enabled=True, progress=False,
                           config_dict={})
    logger.close()
    assert path.read_text().splitlines() == lines[:2]


def test_resume_auto_with_only_set_aside_checkpoints_says_it_starts_over(tmp_path, caplog):
    (tmp_path / "corrupt_step_000004").mkdir()
    with caplog.at_level(logging.WARNING, logger="msa_train.checkpoint"):
        assert CheckpointManager(tmp_path, rank=0).resolve("auto") is None
    assert any("only corrupt_step_000004 set aside" in r.getMessage() and "from step 0" in r.getMessage()
               for r in caplog.records)
