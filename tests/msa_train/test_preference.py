"""The reference-free preference objectives (train.objective=simpo|orpo, msa_train/preference.py):
their losses against values computed by hand, and tiny CPU runs that learn a toy preference."""
import json
import math

import pytest
import torch

from msa_train.preference import pair_loss
from tests.msa_train._util import compose, train
from tests.msa_train.test_dpo import _args, pairs  # noqa: F401  (the fixture)


def _sig(x):
    return 1 / (1 + math.exp(-x))


def test_pair_losses_equal_hand_computed_values():
    logps = torch.tensor([[-6.0, -12.0], [-9.0, -4.0]], dtype=torch.float64)  # chosen, rejected summed log-probs
    tokens = torch.tensor([[3.0, 4.0], [3.0, 2.0]], dtype=torch.float64)
    ref = torch.tensor([[-7.0, -10.0], [-8.0, -5.0]], dtype=torch.float64)
    # DPO, beta 0.1: pair 0 margin 0.1 * ((-6 + 7) - (-12 + 10)) = 0.3; pair 1: 0.1 * (-1 - 1) = -0.2
    loss, margin = pair_loss("dpo", logps, tokens, ref, beta=0.1)
    assert margin.tolist() == pytest.approx([0.3, -0.2])
    assert loss.tolist() == pytest.approx([-math.log(_sig(0.3)), -math.log(_sig(-0.2))])
    # SimPO, beta 2, gamma 1: pair 0 rewards 2 * (-6/3) = -4 and 2 * (-12/4) = -6, margin 2; pair 1: -6 vs -4
    loss, margin = pair_loss("simpo", logps, tokens, beta=2.0, simpo_gamma=1.0)
    assert margin.tolist() == pytest.approx([2.0, -2.0])
    assert loss.tolist() == pytest.approx([-math.log(_sig(2.0 - 1.0)), -math.log(_sig(-2.0 - 1.0))])
    # ORPO, lambda 0.1: mean log-probs -2 and -3; log odds log(p / (1 - p)) with p = e^-2, e^-3
    odds = lambda m: math.log(math.exp(m) / (1 - math.exp(m)))  # noqa: E731
    loss, margin = pair_loss("orpo", logps, tokens, orpo_lambda=0.1)
    r0 = odds(-2.0) - odds(-3.0)
    r1 = odds(-3.0) - odds(-2.0)
    assert margin.tolist() == pytest.approx([r0, r1])
    assert loss.tolist() == pytest.approx([2.0 - 0.1 * math.log(_sig(r0)), 3.0 - 0.1 * math.log(_sig(r1))])


def test_kto_loss_equals_hand_computed_values():
    logps = torch.tensor([[-6.0, -12.0], [-9.0, -4.0]], dtype=torch.float64)
    ref = torch.tensor([[-7.0, -10.0], [-8.0, -5.0]], dtype=torch.float64)
    loss, margin = pair_loss("kto", logps, torch.ones(2, 2), ref, beta=0.5, kto_z0=torch.tensor(0.25),
                             kto_weights=(1.0, 2.0))
    # pair 0: 0.5 * (1 * (1 - s(0.5 (1 - 0.25))) + 2 * (1 - s(0.5 (0.25 + 2)))); pair 1: r_c -1, r_r 1
    want0 = 0.5 * ((1 - _sig(0.375)) + 2 * (1 - _sig(1.125)))
    want1 = 0.5 * ((1 - _sig(-0.625)) + 2 * (1 - _sig(-0.375)))
    assert loss.tolist() == pytest.approx([want0, want1])
    assert margin.tolist() == pytest.approx([0.5 * 3, 0.5 * -2])


def test_orpo_log_odds_stay_finite_near_probability_one():
    logps = torch.tensor([[-1e-9, -50.0]], dtype=torch.float64, requires_grad=True)
    loss, margin = pair_loss("orpo", logps, torch.tensor([[1.0, 10.0]]))
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(margin).all() and torch.isfinite(logps.grad).all()


def test_dpo_needs_a_reference_and_unknown_objectives_are_refused():
    for objective in ("dpo", "kto"):
        with pytest.raises(ValueError, match=f"{objective} needs the reference"):
            pair_loss(objective, torch.zeros(1, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match="objective='ipo'"):
        pair_loss("ipo", torch.zeros(1, 2), torch.ones(1, 2))


@pytest.mark.parametrize("objective", ["simpo", "orpo"])
def test_reference_free_objectives_learn_the_preference_without_a_reference_pass(objective, pairs, tmp_path):  # noqa: F811
    args = _args(pairs, tmp_path, "train.steps=12", f"train.objective={objective}", "data.eval_fraction=0.125",
                 "eval.at_start=true")
    _, records = train(args)
    steps = [r for r in records if "loss" in r and "eval_loss" not in r]
    first, last = [r for r in records if "eval_loss" in r]
    assert not (tmp_path / "dpo_reference").exists()  # no reference pass, no stored reference
    # held-out pairs: from chance (the initial model barely tells the two responses apart) to all right
    assert first["eval_reward_accuracy"] <= 0.5 and abs(first["eval_reward_margin"]) < 0.1
    assert last["eval_reward_accuracy"] == 1.0 and last["eval_reward_margin"] > 0.5
    assert steps[-1]["reward_accuracy"] == 1.0 and steps[-1]["loss"] < steps[0]["loss"]


@pytest.mark.parametrize("override, match", [
    ("train.simpo_beta=0", "train.simpo_beta=0"), ("train.simpo_gamma=-1", "train.simpo_gamma"),
    ("train.orpo_lambda=0", "train.orpo_lambda=0"), ("train.kto_beta=-1", "train.kto_beta"),
    ("train.kto_undesirable_weight=0", "train.kto_undesirable_weight")])
def test_preference_settings_are_checked(override, match, pairs, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match=match):
        compose(_args(pairs, tmp_path, "train.objective=simpo", override))


def test_kto_starts_at_half_the_weights_and_learns_the_preference(pairs, tmp_path):  # noqa: F811
    """KTO on the pairs' two responses as a desirable and an undesirable example, with the reference
    pass of DPO: at step 1 the policy is the reference (r = 0, z0 = 0), so every loss is
    (lambda_D + lambda_U) / 4; then held-out reward accuracy reaches 1; resume is exact."""
    args = _args(pairs, tmp_path / "a", "train.steps=12", "train.objective=kto", "data.eval_fraction=0.125",
                 "eval.at_start=true", "train.kto_undesirable_weight=2.0")
    _, records = train(args)
    steps = [r for r in records if "loss" in r and "eval_loss" not in r]
    first, last = [r for r in records if "eval_loss" in r]
    assert steps[0]["loss"] == pytest.approx(0.75, abs=1e-6) and first["eval_loss"] == pytest.approx(0.75, abs=1e-6)
    assert (tmp_path / "a" / "dpo_reference" / "rank_00000.pt").is_file()
    assert last["eval_reward_accuracy"] == 1.0 and last["eval_reward_margin"] > 0 and last["eval_loss"] < 0.7
    b = [a if not a.startswith("train.output_dir") else f"train.output_dir={tmp_path / 'b'}" for a in args]
    train(b, stop_after=6)
    _, resumed = train([*b, "train.resume=auto"])
    for x, y in zip(steps, [r for r in resumed if "loss" in r and "eval_loss" not in r]):
        assert y["loss"] == pytest.approx(x["loss"], abs=1e-6), (x["step"], x["loss"], y["loss"])


def test_unpaired_kto_loss_equals_hand_computed_values():
    logps = torch.tensor([[-6.0, 0.0], [-9.0, 0.0], [-3.0, 0.0]], dtype=torch.float64)  # example, its padding
    ref = torch.tensor([[-7.0, 0.0], [-8.0, 0.0], [-3.0, 0.0]], dtype=torch.float64)
    desirable = torch.tensor([True, False, False])
    loss, margin = pair_loss("kto", logps, torch.ones(3, 2), ref, beta=0.5, kto_z0=torch.tensor(0.25),
                             kto_weights=(1.0, 2.0), desirable=desirable)
    # r = 1, -1, 0; z = 0.5 (r - 0.25) = 0.375, -0.625, -0.125
    assert loss.tolist() == pytest.approx([1 - _sig(0.375), 2 * (1 - _sig(0.625)), 2 * (1 - _sig(0.125))])
    assert margin.tolist() == pytest.approx([0.375, 0.625, 0.125])  # > 0: the reward sides with the label
    with pytest.raises(ValueError, match="unpaired examples"):
        pair_loss("simpo", logps, torch.ones(3, 2), desirable=desirable)


@pytest.fixture
def kto_examples(tmp_path):
    path = tmp_path / "kto.jsonl"
    rows = [{"prompt": f"Question {i}: what colour is the sky? ",
             "completion": "It is blue, as every day." if i % 2 else "It is green, like grass.",
             "label": bool(i % 2)} for i in range(64)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_unpaired_kto_learns_good_from_bad_examples_and_resumes_exactly(kto_examples, tmp_path):
    """data=kto: one example per item with its label; step 1's loss is (lambda_D + lambda_U) / 4 on
    average (r = z0 = 0 for every example: 1/2 weight each); the held-out examples' implicit reward
    comes to side with their labels; a resumed run follows the uninterrupted one."""
    args = ["data=kto", f"data.path={kto_examples}", "attention=full", "train.seq_len=128", "train.lr=1e-3",
            "train.warmup_steps=1", "train.progress=false", "train.save_hf=false", "train.steps=12",
            "data.eval_fraction=0.125", "eval.at_start=true", "train.grad_accum=2"]
    _, records = train([*args, f"train.output_dir={tmp_path / 'a'}"])
    steps = [r for r in records if "loss" in r and "eval_loss" not in r]
    first, last = [r for r in records if "eval_loss" in r]
    assert steps[0]["loss"] == pytest.approx(0.5, abs=1e-6) and first["eval_loss"] == pytest.approx(0.5, abs=1e-6)
    assert first["eval_pairs"] == 8 and last["eval_reward_accuracy"] == 1.0 and last["eval_loss"] < 0.45
    # z0 is the previous step's mean log-ratio, not the example's own: desirable examples count too
    assert steps[-1]["reward_accuracy"] == 1.0 and steps[-1]["loss"] < 0.4
    train([*args, f"train.output_dir={tmp_path / 'b'}"], stop_after=6)
    _, resumed = train([*args, f"train.output_dir={tmp_path / 'b'}", "train.resume=auto"])
    for x, y in zip(steps, [r for r in resumed if "loss" in r and "eval_loss" not in r]):
        assert y["loss"] == pytest.approx(x["loss"], abs=1e-6), (x["step"], x["loss"], y["loss"])


def test_unpaired_kto_records_and_their_fit(tmp_path):
    import numpy as np

    from msa_train.data import build_packed_datasets, byte_tokenizer
    from msa_train.data.sft import fit_sft_record

    def fit_example(*args, **kwargs):  # an unpaired example is cut as an SFT record is: (ids, labels)
        return fit_sft_record(*args, **kwargs)[:2]

    ids, lab = np.arange(10), np.array([-100] * 6 + [6, 7, 8, 9])
    assert fit_example(ids, lab, 12)[0].tolist() == list(range(10))
    kept, kept_lab = fit_example(ids, lab, 7, bos_id=0)  # BOS, the prompt's end, the whole completion
    assert kept.tolist() == [0, 4, 5, 6, 7, 8, 9] and kept_lab.tolist() == [-100, -100, -100, 6, 7, 8, 9]
    assert fit_example(ids, lab, 3, bos_id=0)[0].tolist() == [0, 6, 7]  # the completion cut from the right
    path = tmp_path / "k.jsonl"
    path.write_text(json.dumps({"prompt": "p", "completion": "c", "label": True}) + "\n"
                    + json.dumps({"prompt": "p", "completion": "c", "label": "yes"}) + "\n")
    cfg = compose(["data=kto", f"data.path={path}", "train.seq_len=64"]).data
    with pytest.raises(ValueError, match="'label' must be true .* got 'yes'"):
        build_packed_datasets(cfg, byte_tokenizer(), 64)
    path.write_text(json.dumps({"prompt": "Q? ", "completion": "yes", "label": False}) + "\n")
    ds, _ = build_packed_datasets(cfg, byte_tokenizer(), 64)
    item = ds[0]
    assert item["desirable"] is False and item["cu_seqlens"].tolist() == [0, 8, 64]
    assert (item["labels"] != -100).sum() == 4  # "yes" + EOS
    with pytest.raises(ValueError, match="only train.objective=kto trains on"):
        compose(["data=kto", f"data.path={path}", "train.objective=dpo"])
