"""Preference tuning with DPO (train.objective=dpo, data=preference) on CPU."""
import json
import math

import pytest
import torch

from tests.msa_train._util import compose, read_metrics, train


@pytest.fixture
def pairs(tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"Question {i}: what colour is the sky? ", "chosen": "It is blue, as every day.",
             "rejected": "It is green, like grass."} for i in range(64)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _args(pairs, out, *more):
    return ["data=preference", f"data.path={pairs}", "attention=full", "train.seq_len=128", "train.lr=1e-3",
            "train.warmup_steps=1", "train.progress=false", "train.save_hf=false", f"train.output_dir={out}", *more]


def test_dpo_starts_at_log2_and_learns_the_preference(pairs, tmp_path):
    """... on the training pairs and on held-out ones (evaluated at the start and the end); eval.only
    on the final checkpoint repeats the last evaluation with the reference stored at the start."""
    from msa_train.trainer import Trainer

    args = _args(pairs, tmp_path, "train.steps=12", "data.eval_fraction=0.125", "eval.at_start=true")
    _, records = train(args)
    steps = [r for r in records if "loss" in r]
    # step 1: the policy is the reference, every margin is exactly 0
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert steps[0]["reward_accuracy"] == 0.0 and steps[0]["reward_margin"] == 0.0
    assert steps[-1]["loss"] < 0.5 * math.log(2) and steps[-1]["reward_accuracy"] == 1.0
    assert steps[-1]["reward_margin"] > 0
    assert (tmp_path / "dpo_reference" / "rank_00000.pt").is_file()
    first, last = [r for r in records if "eval_loss" in r]
    assert first["step"] == 0 and last["step"] == 12 and first["eval_pairs"] == last["eval_pairs"] == 8
    assert first["eval_loss"] == pytest.approx(math.log(2), abs=1e-6) and first["eval_reward_margin"] == 0.0
    assert last["eval_loss"] < 0.5 * math.log(2) and last["eval_reward_accuracy"] == 1.0
    again = Trainer(compose([*args, "eval.only=true", "train.resume=auto"])).run()
    assert again["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-6)
    assert again["eval_reward_margin"] == pytest.approx(last["eval_reward_margin"], rel=1e-6)
    with pytest.raises(ValueError, match="eval.only=true with DPO evaluates a checkpoint of a DPO run"):
        Trainer(compose([*args, "eval.only=true", f"train.output_dir={tmp_path / 'fresh'}"]))


def test_pair_logps_are_the_sequences_own(pairs, tmp_path):
    """The packed pair's per-segment log-probabilities equal each sequence run alone through HF."""
    from msa_train.data import build_packed_dataset, build_tokenizer
    from msa_train.models import build_model
    from msa_train.models.causal_lm import CausalLMWithLoss
    from msa_train.trainer import next_token_targets

    cfg = compose(_args(pairs, tmp_path))
    tok = build_tokenizer(cfg.data, None)
    item = build_packed_dataset(cfg.data, tok, 128)[3]
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.attention)
    module = CausalLMWithLoss(model, 64)  # chunks of 64: a chunk boundary inside the pair
    cu = item["cu_seqlens"]
    targets = next_token_targets(item["labels"], cu)
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1), (cu[1:] - cu[:-1]).long()).clamp_max(2)
    with torch.no_grad():
        got = -module(item["input_ids"][None], item["position_ids"][None], targets[None], cu, int(item["max_seqlen"]),
                      segments=seg[None], num_segments=3)
        for s in range(2):
            a, b = int(cu[s]), int(cu[s + 1])
            logits = model(input_ids=item["input_ids"][None, a:b]).logits[0].float()
            logp = torch.log_softmax(logits, -1)
            t = targets[a:b]
            keep = t != -100
            want = logp[keep, t[keep]].sum()
            assert keep.sum() > 0 and got[s].item() == pytest.approx(want.item(), rel=1e-5, abs=1e-4)


def test_dpo_resume_is_exact_and_keeps_its_reference(pairs, tmp_path):
    _, full = train(_args(pairs, tmp_path / "a", "train.steps=6"))
    train(_args(pairs, tmp_path / "b", "train.steps=6"), stop_after=3)
    ref = tmp_path / "b" / "dpo_reference" / "rank_00000.pt"
    stamp = ref.stat().st_mtime_ns
    summary, resumed = train(_args(pairs, tmp_path / "b", "train.steps=6", "train.resume=auto"))
    assert summary["resumed_from"].endswith("step_000003") and ref.stat().st_mtime_ns == stamp
    assert [r["step"] for r in resumed] == list(range(1, 7))
    for a, b in zip(full, resumed):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6), (a["step"], a["loss"], b["loss"])
    with pytest.raises(ValueError, match="no reference log-probabilities"):
        train(_args(pairs, tmp_path / "b", "train.steps=40", "train.resume=auto"))


@pytest.mark.parametrize("overrides, match", [
    (["train.objective=lm"], r"train.objective=dpo\|simpo\|orpo\|kto and data.format=preference go together"),
    (["train.dpo_beta=0"], "train.dpo_beta=0"),
], ids=["lm-on-pairs", "beta"])
def test_dpo_config_errors(overrides, match, pairs, tmp_path):
    with pytest.raises(ValueError, match=match):
        compose(_args(pairs, tmp_path, *overrides))


def test_dpo_needs_pairs():
    with pytest.raises(ValueError, match="go together"):
        compose(["train.objective=dpo"])


@pytest.mark.slow
def test_dpo_two_processes_zero3_match_one_process(pairs, tmp_path):
    """2 ranks with ZeRO-3 (each computes the reference of its own pairs) follow 1 process with
    grad_accum=2, which sees the same two pairs per step."""
    from tests.msa_train._util import run_cli, torchrun_launcher

    common = [a for a in _args(pairs, tmp_path, "train.steps=4", "parallel.zero_stage=3")
              if not a.startswith("train.output_dir")]
    _, one = train([*common, "train.grad_accum=2", f"train.output_dir={tmp_path / 'one'}"])
    launcher = torchrun_launcher(2)
    out = run_cli([*common, f"train.output_dir={tmp_path / 'two'}"], launcher=launcher, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    two = read_metrics(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2, 3, 4]
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6), (a["step"], a["loss"], b["loss"])
        assert b["reward_accuracy"] == a["reward_accuracy"]
    assert sorted(p.name for p in (tmp_path / "two" / "dpo_reference").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]
