"""The run directory is checked at startup, and a checkpoint write that fails on a full disk says so."""
import pytest
import torch

from tests.msa_train._util import FAST, compose


def test_output_dir_that_is_a_file_or_has_a_file_for_checkpoints_fails_at_startup(tmp_path):
    from msa_train.trainer import Trainer

    (tmp_path / "file").write_text("x")
    cfg = compose(["attention=full", "train.steps=1", "train.seq_len=128", *FAST, f"train.output_dir={tmp_path / 'file'}"])
    with pytest.raises(ValueError, match=r"train.output_dir: .*/file exists and is not a directory"):
        Trainer(cfg)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("not a directory")  # as root, chmod would not stop a write
    cfg = compose(["attention=full", "train.steps=1", "train.seq_len=128", *FAST, f"train.output_dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match=r"train.output_dir: .*/run/checkpoints exists and is not a directory"):
        Trainer(cfg)


def test_unwritable_output_dir_is_named_at_startup(tmp_path, monkeypatch):
    import tempfile

    from msa_train.trainer import check_run_dir

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(kwargs.get("dir")))
    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    with pytest.raises(ValueError, match=r"train.output_dir=.*: cannot write there \(Permission denied"):
        check_run_dir(tmp_path / "run")


def test_a_full_disk_at_a_checkpoint_says_so_and_keeps_the_previous_one(tmp_path, monkeypatch):
    import msa_train.checkpoint as checkpoint
    from msa_train.trainer import Trainer

    cfg = compose(["attention=full", "train.steps=2", "train.seq_len=128", "train.save_every=1", *FAST,
                   f"train.output_dir={tmp_path}"])
    trainer = Trainer(cfg)
    real_save, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        calls.append(f)
        if "step_000002" in str(f):  # what torch raises when the disk fills under its writer
            raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0: "
                               "basic_ios::clear: iostream error")
        return real_save(obj, f, *args, **kwargs)
    monkeypatch.setattr(checkpoint.torch, "save", save)
    with pytest.raises(OSError, match=r"checkpoint of step 2: the disk holding .*checkpoints is full .* the partial "
                                      r"write .tmp_step_000002 was removed and the last complete checkpoint, "
                                      r".*step_000001, is intact") as e:
        trainer.train()
    assert e.value.errno == 28
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "step_000001" / "COMPLETE").is_file() and not (ckpts / ".tmp_step_000002").exists()
