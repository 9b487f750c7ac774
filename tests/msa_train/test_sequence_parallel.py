"""Ulysses sequence parallelism (msa_train/parallel/sequence.py) on CPU with torchrun and gloo.

1. The attention of both backends on 4 ranks, as SP 2 x DP 2 and as SP 4 (KV heads split, and
   replicated: 2 and 1 KV heads at SP 4), equals the attention over the whole sequence: outputs and
   input gradients on the rank's tokens, parameter gradients summed over the SP group; so do the
   loss and every parameter gradient of a 2-layer Llama with 2 KV heads at SP 4, under NSA and
   full attention; packed documents cross the ranks' token boundaries (tests/msa_train/sp_worker.py).
2. Training with sequence parallelism follows the same loss curve and gradient norms as without
   it (the same data-parallel ranks, so the same sequences), and so does the held-out evaluation
   at the end: 4 processes as 2 data-parallel ranks of SP 2 against 2 processes, under ZeRO-3 (NSA,
   parameters gathered for the NSA leaf module, then sliced to the rank's KV heads; with
   qwen3_14b_1m's memory options) and ZeRO-2 (full attention, fused kernels); and
   parallel.sp_degree=4 on 4 processes against 1, the tiny model's 2 KV heads each replicated on
   2 ranks (ZeRO-2, NSA).
3. The SP groups' collectives time out as build_layout is told (a 4-rank run with one rank stopped).
4. DPO with parallel.sp_degree=2 follows 1 process: a pair's log-probabilities are added over the
   ranks that hold its tokens.
"""

import pytest

from tests.msa_train._util import FAST, REPO, env, read_metrics, run_cli, torchrun_launcher

STEPS = 3


_launcher = torchrun_launcher


@pytest.mark.slow
def test_sequence_parallel_attention_matches_whole_sequence():
    import subprocess

    out = subprocess.run([*_launcher(4), str(REPO / "tests" / "msa_train" / "sp_worker.py")], cwd=REPO, env=env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "MISMATCH" not in out.stdout
    # every comparison ran on all 4 ranks: 17 for each of the 4 attention cases, 60 for the two models
    assert out.stdout.count(" ok\n") == 4 * (4 * 17 + 60), out.stdout
    assert out.stdout.count("num_key_value_heads (3) must divide one another") == 4, out.stdout


@pytest.mark.slow
def test_sequence_parallel_group_timeout_with_a_stopped_rank():
    """4 ranks as SP 2 x DP 2, the SP groups made with a 3 s timeout: rank 3 stops before its group's
    all-to-all, and rank 2's fails after the timeout (the default group's would wait 30 minutes)."""
    import subprocess

    out = subprocess.run([*_launcher(4), str(REPO / "tests" / "msa_train" / "sp_worker.py"), "stopped"], cwd=REPO,
                         env=env(), capture_output=True, text=True, timeout=150)
    assert out.returncode != 0, out.stdout
    assert "rank 0 exchanged" in out.stdout and "rank 1 exchanged" in out.stdout, out.stdout + out.stderr[-3000:]
    line = next((s for s in out.stdout.splitlines() if s.startswith("rank 2 timed out after")), None)
    assert line is not None, out.stdout + out.stderr[-3000:]
    assert 2.5 <= float(line.split()[5]) < 30, line


def _curve(tmp_path, name, procs, overrides):
    args = [*overrides, f"train.output_dir={tmp_path / name}"]
    out = run_cli(args, launcher=_launcher(procs) if procs > 1 else (), timeout=400)
    assert out.returncode == 0, out.stderr[-4000:]
    return read_metrics(tmp_path / name)


# qwen3_14b_1m's memory options on the sequence-parallel run of the ZeRO-3 case (each rank's 128
# tokens in 2 tiles, its layer inputs offloaded): the same curve as plain processes
MEMORY = ["parallel.activation_checkpointing=true", "parallel.offload_activations=true", "parallel.tile_tokens=64"]


@pytest.mark.slow
# (the second with the fused RMSNorm, RoPE and SwiGLU kernels that CUDA runs by default: RoPE on
# each rank's shard of the positions)
@pytest.mark.parametrize("procs, degree, stage, attention, extra",
                         [(4, 2, 3, "nsa", MEMORY), (4, 2, 2, "full", ["parallel.fused_ops=true"]),
                          (4, 4, 3, "nsa", [])],
                         ids=["dp2xsp2-zero3-nsa-memory", "dp2xsp2-zero2-full-fused", "sp4-zero3-nsa-kv-replicated"])
def test_sequence_parallel_training_matches(tmp_path, procs, degree, stage, attention, extra):
    common = [f"attention={attention}", f"train.steps={STEPS}", "train.seq_len=256", f"parallel.zero_stage={stage}",
              *FAST, "data.eval_fraction=0.125", "eval.max_sequences=6", "eval.passkey=3"]  # at the end, sharded
    ref = _curve(tmp_path, "ref", procs // degree, common)
    sp = _curve(tmp_path, "sp", procs, [*common, f"parallel.sp_degree={degree}", *extra])
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
@pytest.mark.parametrize("objective", ["dpo", "simpo", "kto"])
def test_sequence_parallel_preference_matches(tmp_path, objective):
    """Every pair spans both halves of the 128 tokens (the rejected sequence crosses token 64), so each
    rank holds part of it: loss, reward statistics and gradient norm per step, and the held-out
    evaluation at the start (DPO: the reference, margin 0) and the end, as on 1 process. SimPO's
    length normalisation counts the whole responses' tokens, not a rank's share."""
    import json

    pairs = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"Question {i}: what colour is the sky? ", "chosen": "It is blue, as every day.",
             "rejected": "It is green, like grass."} for i in range(40)]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["data=preference", f"data.path={pairs}", "attention=nsa", "train.seq_len=128", "train.lr=1e-3",
              "train.warmup_steps=1", f"train.steps={STEPS}", "parallel.zero_stage=2", "data.eval_fraction=0.2",
              "eval.at_start=true", "train.progress=false", "train.save_hf=false", f"train.objective={objective}"]
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
    assert [r["step"] for r in evals[1]] == [0, STEPS]
    assert evals[1][0]["eval_reward_margin"] == 0.0 or objective == "simpo"  # DPO, KTO: the policy is the reference
    for a, b in zip(*evals):
        assert b["eval_pairs"] == a["eval_pairs"] == 8
        for key in ("eval_loss", "eval_reward_margin"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), (key, a[key], b[key])


def test_sequence_parallel_config_errors():
    from msa_train.parallel.sequence import build_layout

    with pytest.raises(ValueError, match="sp_degree=3 must divide the number of processes"):
        build_layout(3, 0, 4)
    assert build_layout(1, 1, 2).sp is None and build_layout(1, 1, 2).dp_rank == 1


@pytest.mark.parametrize("heads, kv_heads, degree, want", [
    (32, 8, 2, (16, 4, 1)), (32, 8, 8, (4, 1, 1)), (32, 8, 16, (2, 1, 2)),  # Llama 3 8B
    (40, 8, 8, (5, 1, 1)),  # Qwen3 14B, Qwen2.5 32B
    (4, 2, 4, (1, 1, 2)), (8, 1, 4, (2, 1, 4)),  # the tiny model; MQA
], ids=lambda x: str(x))
def test_head_layout(heads, kv_heads, degree, want):
    from msa_train.parallel.sequence import HeadLayout, head_layout

    assert head_layout(heads, kv_heads, degree) == HeadLayout(*want)


@pytest.mark.parametrize("heads, kv_heads, degree, match", [
    (40, 8, 16, r"sp_degree=16 must divide the model's num_attention_heads \(40\)"),
    (40, 8, 5, r"sp_degree=5 and the model's num_key_value_heads \(8\) must divide one another"),
], ids=["qwen3-sp16", "qwen3-sp5"])
def test_head_layout_refuses(heads, kv_heads, degree, match):
    """A degree that does not fit the heads fails at config time (model.hf_config) and in head_layout."""
    from msa_train.parallel.sequence import head_layout
    from tests.msa_train._util import compose

    with pytest.raises(ValueError, match=match):
        head_layout(heads, kv_heads, degree)
    with pytest.raises(ValueError, match=match):
        compose(["model=qwen3_14b", f"parallel.sp_degree={degree}", "train.seq_len=1280"])
