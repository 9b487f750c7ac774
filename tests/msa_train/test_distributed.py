"""ZeRO-2 / ZeRO-3 across 2 processes (torchrun, or DeepSpeed's launcher; gloo) match one process with
the same global batch.

Both runs use the same ZeRO stage (ZeRO-3 builds the model under deepspeed.zero.Init, whose
random initialisation differs from a plain build). One process with grad_accum=2 sees the same two packed sequences per step as two ranks with
grad_accum=1 (the sampler deals one global order round-robin), and the loss is token-weighted
over the global batch in both, so the curves agree up to fp32 reduction order.
"""
import subprocess
import sys

import pytest

from tests.msa_train._util import FAST, REPO, env, free_port, read_metrics, run_cli, torchrun_launcher, train

STEPS = 4


_port = free_port


@pytest.mark.slow
@pytest.mark.parametrize("stage, attention", [(2, "full"), (3, "nsa")], ids=["zero2-full", "zero3-nsa"])
def test_two_process_zero_matches_one_process(tmp_path, stage, attention):
    # with held-out evaluation every 2 steps: 5 of the 35 held-out sequences and 3 pass-key probes, so
    # one rank runs uncounted forwards to keep ZeRO-3's collectives in step
    common = [f"attention={attention}", f"train.steps={STEPS}", "train.seq_len=256", *FAST, "data.eval_fraction=0.125",
              "eval.max_sequences=5", "eval.every=2", "eval.passkey=3"]
    _, ref = train([*common, f"parallel.zero_stage={stage}", "train.grad_accum=2",
                    f"train.output_dir={tmp_path / 'one'}"])
    launcher = torchrun_launcher(2)
    out = run_cli([*common, f"parallel.zero_stage={stage}", "train.grad_accum=1", "train.save_hf=true",
                   f"train.output_dir={tmp_path / 'two'}"], launcher=launcher, timeout=400)
    assert out.returncode == 0, out.stderr[-4000:]
    two = read_metrics(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2, 2, 3, 4, 4]  # training records and evaluations
    for a, b in zip(ref, two):
        for key in ("loss", "eval_loss", "eval_loss_pos_0_8", "eval_passkey_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), (a["step"], key, a[key], b[key])
        assert b.get("eval_tokens") == a.get("eval_tokens")
    assert (tmp_path / "two" / "hf" / "model.safetensors").is_file()


@pytest.mark.slow
def test_deepspeed_launcher_runs_the_cli(tmp_path):
    # DeepSpeed's own launcher (what `deepspeed --num_gpus 2 --module msa_train.cli ...` runs) appends
    # --local_rank=N to each rank's command line; the CLI drops it, and 2 ranks under ZeRO-2 follow
    # one process with the same global batch
    common = ["attention=full", "train.steps=2", "train.seq_len=256", *FAST, "parallel.zero_stage=2"]
    _, ref = train([*common, "train.grad_accum=2", f"train.output_dir={tmp_path / 'one'}"])
    cmd = [sys.executable, "-c", "from deepspeed.launcher.runner import main; main()", "--num_gpus", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(_port()), "--module", "msa_train.cli",
           *common, "train.grad_accum=1", f"train.output_dir={tmp_path / 'two'}"]
    out = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "'--local_rank=0'" in out.stdout + out.stderr  # the launcher did pass it
    two = read_metrics(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2]
    for a, b in zip(ref, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5)


def test_a_stopped_rank_fails_its_peer_within_the_timeout_naming_it(tmp_path):
    """Rank 1 is SIGSTOPped mid-training: rank 0's next collective times out after parallel.timeout_s
    (not torch's default 30 minutes) and the run fails with a message naming rank 1 and the setting."""
    import os
    import signal
    import time

    import psutil

    timeout_s = 4
    args = ["attention=full", "train.steps=500", "train.seq_len=128", *FAST, "train.save_final=false",
            f"parallel.timeout_s={timeout_s}", f"train.output_dir={tmp_path}"]
    cmd = [*torchrun_launcher(2), "-m", "msa_train.cli", *args]
    log = open(tmp_path / "log.txt", "w+")
    launcher = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=log, stderr=subprocess.STDOUT)
    stopped = None
    try:
        deadline = time.monotonic() + 240
        while not ((tmp_path / "metrics.jsonl").is_file() and (tmp_path / "metrics.jsonl").read_text().strip()):
            assert launcher.poll() is None and time.monotonic() < deadline, (tmp_path / "log.txt").read_text()[-3000:]
            time.sleep(0.2)
        workers = {int(p.environ()["RANK"]): p for p in psutil.Process(launcher.pid).children(recursive=True)
                   if "RANK" in p.environ()}
        stopped = workers[1]
        stopped.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        psutil.wait_procs([workers[0]], timeout=2 * timeout_s + 30)
        elapsed = time.monotonic() - t0
        assert not workers[0].is_running(), ("rank 0 still waits for the stopped rank", (tmp_path / "log.txt").read_text()[-3000:])
    finally:
        if stopped is not None:
            os.kill(stopped.pid, signal.SIGKILL)  # a stopped process takes SIGKILL (torchrun's SIGTERM waits)
        try:
            launcher.wait(timeout=60)
        finally:
            if launcher.poll() is None:
                launcher.kill()
    out = (tmp_path / "log.txt").read_text()
    assert launcher.returncode != 0
    assert elapsed < 2 * timeout_s + 20, elapsed  # the timeout, the barrier that names the rank, a margin
    assert (f"msa-train: error: rank 0: a collective got no answer from rank 1 within parallel.timeout_s={timeout_s} s"
            in out), out[-3000:]
    assert "Traceback" not in out.split("msa-train: error:")[0].splitlines()[-1]
