"""ZeRO-2 / ZeRO-3 across 2 processes (torchrun, gloo) match one process with the same global batch.

Both runs use the same ZeRO stage (ZeRO-3 builds the model under deepspeed.zero.Init, whose
random initialisation differs from a plain build). One process with grad_accum=2 sees the same two packed sequences per step as two ranks with
grad_accum=1 (the sampler deals one global order round-robin), and the loss is token-weighted
over the global batch in both, so the curves agree up to fp32 reduction order.
"""
import socket
import sys

import pytest

from tests.msa_train._util import FAST, read_metrics, run_cli, train

STEPS = 4


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("stage, attention", [(2, "full"), (3, "nsa")], ids=["zero2-full", "zero3-nsa"])
def test_two_process_zero_matches_one_process(tmp_path, stage, attention):
    common = [f"attention={attention}", f"train.steps={STEPS}", "train.seq_len=256", *FAST]
    _, ref = train([*common, f"parallel.zero_stage={stage}", "train.grad_accum=2",
                    f"train.output_dir={tmp_path / 'one'}"])
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(_port())]
    out = run_cli([*common, f"parallel.zero_stage={stage}", "train.grad_accum=1", "train.save_hf=true",
                   f"train.output_dir={tmp_path / 'two'}"], launcher=launcher, timeout=400)
    assert out.returncode == 0, out.stderr[-4000:]
    two = read_metrics(tmp_path / "two")
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    for a, b in zip(ref, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5), (a["step"], a["loss"], b["loss"])
    assert (tmp_path / "two" / "hf" / "model.safetensors").is_file()
