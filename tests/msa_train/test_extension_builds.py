"""DeepSpeed's optimizers compile C++ extensions on first use, under a lock file that torch's loader
removes when the build ends and that every other process waits on with no time limit. A build that
was killed leaves the file: the next run must fail naming it, not wait for ever (a CI run of this
suite once hung there for the whole of its 90 minutes)."""
import os
import threading
import time

import pytest

from msa_train.parallel.deepspeed_config import build_deepspeed_config
from msa_train.parallel.engine import extension_build_locks, wait_for_extension_builds
from tests.msa_train._util import FAST, compose, run_cli

OFFLOAD = ["parallel=zero2", "parallel.offload_optimizer=true", "parallel.optimizer=deepspeed"]


def _ds_config(overrides):
    cfg = compose(["attention=full", *overrides])
    return build_deepspeed_config(cfg.parallel, cfg.train, world_size=1, bf16=False)


@pytest.mark.parametrize("overrides, names", [
    ([], []),  # torch's AdamW builds nothing
    (["parallel.optimizer=deepspeed"], ["fused_adam"]),
    (OFFLOAD, ["cpu_adam"]),
    (["parallel=zero3", "parallel.offload_optimizer=true", "parallel.optimizer=deepspeed", "parallel.offload_ratio=0.5"],
     ["cpu_adam"]),  # the GPU's share: torch's AdamW
])
def test_the_locks_are_those_of_the_extensions_the_optimizer_builds(tmp_path, monkeypatch, overrides, names):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extension_build_locks(_ds_config(overrides)) == [tmp_path / n / "lock" for n in names]


def test_a_lock_older_than_any_build_is_an_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    hour_ago = time.time() - 3600
    os.utime(lock, (hour_ago, hour_ago))
    with pytest.raises(ValueError, match=f"{lock}: a lock left by a build of DeepSpeed's cpu_adam extension that "
                                         "never finished \\(60 minutes old"):
        wait_for_extension_builds(_ds_config(OFFLOAD))


def test_a_build_in_progress_is_waited_for(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    threading.Timer(0.5, lock.unlink).start()  # another process's build ends
    t0 = time.monotonic()
    wait_for_extension_builds(_ds_config(OFFLOAD), poll_s=0.05)
    assert 0.4 < time.monotonic() - t0 < 5
    lock.touch()  # a build still running at the limit counts as a killed one
    with pytest.raises(ValueError, match="never finished"):
        wait_for_extension_builds(_ds_config(OFFLOAD), stale_after_s=0.3, poll_s=0.05)


@pytest.mark.slow
def test_the_cli_fails_on_a_left_lock_instead_of_hanging(tmp_path):
    lock = tmp_path / "ext" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (time.time() - 3600,) * 2)
    out = run_cli(["attention=full", "train.seq_len=128", "train.steps=2", *FAST, *OFFLOAD,
                   f"train.output_dir={tmp_path / 'run'}"], extra_env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")},
                  timeout=180)
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"msa-train: error: {lock}: a lock left by a build" in out.stderr, out.stderr[-3000:]
