"""Ulysses sequence parallelism (msa_train/parallel/sequence.py) on CPU with torchrun and gloo.

1. The attention of both backends on 2 ranks, each holding half the tokens, equals the attention
   over the whole sequence: outputs and input gradients on the rank's tokens, parameter gradients
   summed over the ranks (tests/msa_train/sp_worker.py).
2. Training with parallel.sp_degree=2 on 2 processes follows the same loss curve as 1 process
   (one data-parallel rank either way, so the same sequences), with ZeRO-3 too (parameters
   gathered for the NSA leaf module, then sliced to the rank's KV heads); 4 processes as 2
   data-parallel ranks of 2 follow 2 processes without it.
3. DPO with parallel.sp_degree=2 follows 1 process: a pair's log-probabilities are added over the
   ranks that hold its tokens.
"""
import socket
import sys

import pytest

from tests.msa_train._util import FAST, REPO, env, read_metrics, run_cli

STEPS = 3


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher(n: int):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
            "--master-addr", "127.0.0.1", "--master-port", str(_port())]


@pytest.mark.slow
def test_sequence_parallel_attention_matches_whole_sequence():
    import subprocess

    out = subprocess.run([*_launcher(2), str(REPO / "tests" / "msa_train" / "sp_worker.py")], cwd=REPO, env=env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "MISMATCH" not in out.stdout
    assert out.stdout.count(" ok") == 2 * 17, out.stdout  # all 17 comparisons ran on both ranks


def _curve(tmp_path, name, procs, overrides):
    args = [*overrides, f"train.output_dir={tmp_path / name}"]
    out = run_cli(args, launcher=_launcher(procs) if procs > 1 else (), timeout=400)
    assert out.returncode == 0, out.stderr[-4000:]
    return read_metrics(tmp_path / name)


# qwen3_14b_1m's memory options on the sequence-parallel run of the ZeRO-3 case (each rank's 128
# tokens in 2 tiles, its layer inputs offloaded): the same curve as one plain process
MEMORY = ["parallel.activation_checkpointing=true", "parallel.offload_activations=true", "parallel.tile_tokens=64"]


@pytest.mark.slow
# (the second with the fused RMSNorm, RoPE and SwiGLU kernels that CUDA runs by default: RoPE on
# each rank's shard of the positions)
@pytest.mark.parametrize("procs, stage, attention, extra",
                         [(2, 3, "nsa", MEMORY), (4, 2, "full", ["parallel.fused_ops=true"])],
                         ids=["sp2-zero3-nsa-memory", "dp2xsp2-zero2-full-fused"])
def test_sequence_parallel_training_matches(tmp_path, procs, stage, attention, extra):
    common = [f"attention={attention}", f"train.steps={STEPS}", "train.seq_len=256", f"parallel.zero_stage={stage}",
              *FAST, "data.eval_fraction=0.125", "eval.max_sequences=6", "eval.passkey=3"]  # at the end, sharded
    ref = _curve(tmp_path, "ref", procs // 2, common)
    sp = _curve(tmp_path, "sp", procs, [*common, "parallel.sp_degree=2", *extra])
    assert [r["step"] for r in sp] == [*range(1, STEPS + 1), STEPS]
    for a, b in zip(ref[:STEPS], sp):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6), (a["step"], a["loss"], b["loss"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (a["step"], a["grad_norm"], b["grad_norm"])
        assert b["tokens_seen"] == a["tokens_seen"]  # an SP group counts its sequence once
        assert b["document_tokens_per_s"] / b["tokens_per_s"] == \
            pytest.approx(a["document_tokens_per_s"] / a["tokens_per_s"], rel=1e-9)  # and its documents
    a, b = ref[-1], sp[-1]
    assert b["eval_tokens"] == a["eval_tokens"] and b["eval_passkey_accuracy"] == a["eval_passkey_accuracy"]
    for key in ("eval_loss", "eval_loss_pos_128_256", "eval_passkey_loss", "eval_passkey_token_accuracy"):
        assert b[key] == pytest.approx(a[key], rel=1e-5), (key, a[key], b[key])


@pytest.mark.slow
def test_sequence_parallel_dpo_matches(tmp_path):
    """Every pair spans both halves of the 128 tokens (the rejected sequence crosses token 64), so each
    rank holds part of it: loss, reward statistics and gradient norm per step, and the held-out
    evaluation at the start (the reference: margin 0) and the end, as on 1 process."""
    import json

    pairs = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"Question {i}: what colour is the sky? ", "chosen": "It is blue, as every day.",
             "rejected": "It is green, like grass."} for i in range(40)]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["data=preference", f"data.path={pairs}", "attention=nsa", "train.seq_len=128", "train.lr=1e-3",
              "train.warmup_steps=1", f"train.steps={STEPS}", "parallel.zero_stage=2", "data.eval_fraction=0.2",
              "eval.at_start=true", "train.progress=false", "train.save_hf=false"]
    ref = _curve(tmp_path, "ref", 1, common)
    sp = _curve(tmp_path, "sp", 2, [*common, "parallel.sp_degree=2"])
    steps = [[r for r in run if "loss" in r] for run in (ref, sp)]
    assert [r["step"] for r in steps[1]] == list(range(1, STEPS + 1))
    for a, b in zip(*steps):
        for key in ("loss", "reward_margin", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key, a[key], b[key])
        assert b["reward_accuracy"] == a["reward_accuracy"]
    assert steps[0][-1]["reward_margin"] > 0  # it learned: the comparison is not of constants
    evals = [[r for r in run if "eval_loss" in r] for run in (ref, sp)]
    assert [r["step"] for r in evals[1]] == [0, STEPS] and evals[1][0]["eval_reward_margin"] == 0.0
    for a, b in zip(*evals):
        assert b["eval_pairs"] == a["eval_pairs"] == 8
        for key in ("eval_loss", "eval_reward_margin"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), (key, a[key], b[key])


def test_sequence_parallel_config_errors():
    from msa_train.parallel.sequence import build_layout

    with pytest.raises(ValueError, match="sp_degree=3 must divide the number of processes"):
        build_layout(3, 0, 4)
    assert build_layout(1, 1, 2).sp is None and build_layout(1, 1, 2).dp_rank == 1
