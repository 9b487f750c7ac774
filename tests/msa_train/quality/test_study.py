"""The whole quality pipeline at tiny size on CPU: corpus, study A, study B, report (msa_train/quality)."""
import dataclasses
import json
import shutil
import time
from pathlib import Path

import pytest

from msa_train.quality.study import Plan, _loss_at_wall, steps_to_within


def test_steps_to_within():
    assert steps_to_within([2.0, 1.5, 1.005, 1.0], [1.0, 1.0, 1.0, 1.0], window=1) == 3
    assert steps_to_within([2.0, 1.0, 2.0], [1.0, 1.0, 1.0], window=1) is None


def test_loss_at_wall_means_the_steps_done_by_then():
    curve = [{"wall_s": float(i), "loss": float(i)} for i in range(1, 11)]
    assert _loss_at_wall(curve, 6.0, window=3) == 6.0      # steps at 5, 6, 7 s: centred on the step done at 6 s
    assert _loss_at_wall(curve, 6.0, window=4) == 5.5      # steps at 4..7 s
    assert _loss_at_wall(curve, 10.0, window=3) == 9.0     # the run ends there: its last three steps
    assert _loss_at_wall(curve, 99.0, window=3) == 9.0
    assert _loss_at_wall(curve, 1.0, window=5) == 2.0      # the first steps: as many as there are
    assert _loss_at_wall(curve, 0.5, window=3) is None
    for r in curve:  # logged with label_tokens: a mean weighted by them (answers-only steps count less)
        r["label_tokens"] = 100 if r["wall_s"] == 6.0 else 1000
    assert _loss_at_wall(curve, 6.0, window=3) == pytest.approx((5 * 1000 + 6 * 100 + 7 * 1000) / 2100)


def test_study_b_defaults_to_a_tenth_of_the_recipes_steps():
    from pathlib import Path

    from omegaconf import OmegaConf

    from msa_train.quality.study import RECIPE_STEPS

    recipe = OmegaConf.load(Path(__file__).parents[3] / "recipes" / "quality_170m.yaml")
    assert recipe.train.steps == RECIPE_STEPS and Plan.gpu().conversion_steps == RECIPE_STEPS // 10


def test_all_runs_study_a_first_then_the_retrieval_phase_then_b_and_the_seed(tmp_path):
    from msa_train.quality.study import _jobs_all

    plan = Plan.gpu()
    assert [list(stage) for stage in _jobs_all(plan, tmp_path)] == [
        ["a_full", "a_fmsa"], ["b_dense", "b_nsa", "b_nsa_distill", "a_full_seed1"]]  # no phase unless asked
    plan = dataclasses.replace(plan, retrieval_phase_steps=300, mean_phi_arm=True)
    first, second = _jobs_all(plan, tmp_path)
    assert list(second) == ["c_fmsa", "c_full", "b_dense", "b_nsa", "b_nsa_distill", "a_full_seed1", "a_fmsa_mean_phi"]
    for arm in ("full", "fmsa"):
        job = second[f"c_{arm}"]
        assert f"model.path={tmp_path / 'runs' / f'a_{arm}' / 'hf'}" in job and f"attention={arm}" in job
        assert f"data.path={tmp_path / 'data' / 'retrieval_phase.jsonl'}" in job and "train.steps=300" in job
        assert job.index("train.steps=300") > job.index("recipe=quality_170m")  # overrides the recipe's steps
        assert [x for x in job if x.startswith("train.seq_len=")] == ["train.seq_len=8192"]  # short: many updates
        assert "eval.seq_len=16384" in job  # held-out loss packed as study A's
        assert not any(x.startswith("eval.retrieval=") for x in job)
        # 3e-4 after 100 warm-up steps (the eighth run: above 4e-4 the 169M model's loss rose), held,
        # then decayed over the second half (the ninth run: the dense model's copy came in its decay)
        assert "train.lr=0.0003" in job and "train.warmup_steps=100" in job
        assert job.index("train.lr_schedule=wsd") > job.index("recipe=quality_170m")
        assert not any(x.startswith("train.min_lr_ratio=") for x in job)  # to the recipe's tenth
    from msa_train.cli import compose  # the job composes: decay over the second half, to the recipe's tenth
    cfg = compose([*second["c_fmsa"], f"train.output_dir={tmp_path / 'c'}"])
    assert (cfg.train.lr_schedule, cfg.train.decay_fraction, cfg.train.min_lr_ratio) == ("wsd", 0.5, 0.1)
    shorter = _jobs_all(dataclasses.replace(plan, retrieval_phase_decay=0.25), tmp_path)[1]["c_full"]
    assert compose([*shorter, f"train.output_dir={tmp_path / 'd'}"]).train.decay_fraction == 0.25
    cosine = _jobs_all(dataclasses.replace(plan, retrieval_phase_schedule="cosine"), tmp_path)[1]["c_fmsa"]
    assert not any(x.startswith(("train.min_lr_ratio=", "train.lr_schedule=")) for x in cosine)  # the recipe's
    constant = _jobs_all(dataclasses.replace(plan, retrieval_phase_schedule="constant"), tmp_path)[1]["c_fmsa"]
    assert "train.min_lr_ratio=1.0" in constant and not any(x.startswith("train.lr_schedule=") for x in constant)


def test_study_c_sequences_pack_its_documents_without_much_padding():
    """Study C's documents (BOS/EOS added) fill its sequences: at 4K, two 2K documents did not fit one
    sequence, and the eighth run's sequences were 30% padding, many a lone 2K question of a few trained tokens."""
    import random

    import numpy as np

    from msa_train.data.packing import plan_packing
    from msa_train.quality.tasks import draw_length

    plan = Plan.gpu()
    assert plan.retrieval_phase_length_spread == 0.125
    rng = random.Random(0)
    # each document's tokens: its drawn length (tasks.draw_length), BOS/EOS, and up to 40 of re-tokenising the text
    lengths = np.array([draw_length(rng, plan.retrieval_phase_lengths, plan.retrieval_phase_length_spread) + 2
                        + rng.randint(0, 40) for _ in range(6000)])
    packed = plan_packing(lengths, plan.retrieval_phase_seq_len, seed=0)
    assert 1 - lengths.sum() / (len(packed) * plan.retrieval_phase_seq_len) < 0.05
    per_sequence = np.diff(packed.seq_ptr)
    assert (per_sequence == 1).mean() < 0.01  # hardly a document alone in its sequence


def test_steps_option_sizes_both_studies():
    plan = Plan.gpu().with_steps(240)
    assert plan.recipe_overrides[-1] == "train.steps=240" and plan.conversion_steps == 24
    with pytest.raises(ValueError, match="--steps 5"):
        Plan.gpu().with_steps(5)


def test_tiny_pipeline_end_to_end(tiny_corpus, tmp_path, monkeypatch):
    from msa_train.quality.__main__ import main

    from msa_train.trainer import Trainer

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    step = Trainer.train_step

    def slow_step(self):  # a tiny step can end before the budget's stop signal is sent: 0.5 s each
        time.sleep(0.5)
        return step(self)
    _, corpus, _ = tiny_corpus
    work, out = tmp_path / "work", tmp_path / "out"
    shutil.copytree(corpus, work / "corpus")
    with monkeypatch.context() as m:
        m.setattr(Trainer, "train_step", slow_step)
        assert main(["study-a", "--work", str(work), "--out", str(out), "--tiny", "--budget-s", "1",
                     "--mix-fraction", "0.08", "--mix-targets", "answers"]) == 3  # a piece
    mix = json.loads((work / "data" / "mix.json").read_text())
    assert mix["mix_fraction"] == 0.08 and mix["synthetic_targets"] == "answers"
    records = [json.loads(line) for line in (work / "data" / "train_mix.jsonl").read_text().splitlines()]
    synthetic = [r for r in records if "segments" in r]  # the corpus's documents train whole, the mix its answers
    assert len(synthetic) == mix["synthetic_documents"] and len(records) == len(synthetic) + mix["corpus_documents"]
    assert all([x["train"] for x in r["segments"]] == [False, True] for r in synthetic)  # one question each (tiny)
    with pytest.raises(SystemExit, match="--mix-fraction 2"):
        main(["all", "--work", str(work), "--tiny", "--mix-fraction", "2"])
    state = json.loads((work / "state.json").read_text())
    assert not state["a_full"]["done"] and 1 <= state["a_full"]["step"] < 3
    assert json.loads((out / "summary.json").read_text())["from_scratch"]["full"]["done"] is False
    with pytest.raises(ValueError, match="finish study-a"):
        main(["study-b", "--work", str(work), "--out", str(out), "--tiny"])
    with pytest.raises(ValueError, match="finish study-a"):
        main(["study-c", "--work", str(work), "--out", str(out), "--tiny", "--retrieval-phase", "2"])
    assert main(["all", "--work", str(work), "--out", str(out), "--tiny"]) == 0  # continues, then study B
    state = json.loads((work / "state.json").read_text())
    assert list(state) == ["a_full", "a_fmsa", "b_dense", "b_nsa", "b_nsa_distill", "a_full_seed1"]  # priority order
    assert all(v["done"] for v in state.values())
    s = json.loads((out / "summary.json").read_text())
    for name in ("full", "fmsa"):
        e = s["from_scratch"][name]
        assert e["done"] is True and e["retrieval_answer_loss"] > 0
        assert e["tokens"] == 3 * 256 and e["wall_s"] > 0 and e["final_eval_loss"] > 0
        assert set(e["retrieval"]) == {"passkey", "single_needle"} and set(e["retrieval"]["passkey"]) == {"384", "512"}
        assert 0 <= e["retrieval_token_accuracy"] <= 1 and 0 <= e["retrieval_first_token_accuracy"] <= 1
        assert e["retrieval_first_token"].keys() == e["retrieval"].keys()
        assert e["retrieval_first_token"]["passkey"].keys() == e["retrieval"]["passkey"].keys()
        assert e["step_at_equal_wall"] in (None, 1, 2, 3)  # None: no step done by the other run's end
        by_length = e["retrieval_by_length"]
        assert set(by_length) == {"token_accuracy", "answer_loss", "first_token_accuracy"}
        assert set(by_length["answer_loss"]["single_needle"]) == {"384", "512"}
        assert all(v > 0 for v in by_length["answer_loss"]["passkey"].values())
    assert s["from_scratch"]["dense_seed_spread"] is not None
    for name in ("dense_continued", "nsa_converted", "nsa_distilled"):
        e = s["conversion"][name]
        for key in ("tokens", "loss_after_patch", "steps_to_1pct", "final_eval_loss", "retrieval"):
            assert key in e, (name, key)
        assert e["tokens"] == 2 * 256 and e["retrieval"]["single_needle"]["512"].keys() == {"0", "1"}
    assert s["conversion"]["dense_continued"]["steps_to_1pct"] == 0
    assert s["conversion"]["nsa_distilled"]["distill"]["steps"] == 3
    for png in ("retrieval_from_scratch.png", "retrieval_conversion.png", "loss_tokens.png", "loss_wall.png",
                "loss_by_position.png", "conversion_loss.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG", png
    assert "fmsa_mean_phi" not in s["from_scratch"]
    # the ablation of phi's parameters, on request, after the rest
    assert main(["study-a", "--work", str(work), "--out", str(out), "--tiny", "--mean-phi-arm"]) == 0
    assert list(json.loads((work / "state.json").read_text()))[-1] == "a_fmsa_mean_phi"
    s = json.loads((out / "summary.json").read_text())["from_scratch"]
    assert s["fmsa_mean_phi"]["done"] and s["fmsa_mean_phi"]["final_eval_loss"] > 0
    assert s["fmsa_mean_phi_vs_full_eval_loss"] == pytest.approx(
        s["fmsa_mean_phi"]["final_eval_loss"] / s["full"]["final_eval_loss"] - 1)
    assert s["fmsa_mean_phi"]["retrieval"] is None  # held-out loss only
    # study C: both from-scratch models trained on retrieval documents alone, answers only
    with pytest.raises(SystemExit, match="--retrieval-phase 0"):
        main(["study-c", "--work", str(work), "--tiny", "--retrieval-phase", "0"])
    assert main(["study-c", "--work", str(work), "--out", str(out), "--tiny", "--retrieval-phase", "2"]) == 0
    assert list(json.loads((work / "state.json").read_text()))[-2:] == ["c_fmsa", "c_full"]
    data = json.loads((work / "data" / "retrieval_phase.json").read_text())
    records = [json.loads(line) for line in (work / "data" / "retrieval_phase.jsonl").read_text().splitlines()]
    # two 256-token sequences: one retrieval document (one question) and one copy document
    assert len(records) == data["documents"] == 2 and data["questions"] == 1 and data["copy_documents"] == 1
    assert data["copy_fraction"] == 0.5 and data["tasks"] == ["passkey", "single_needle"]
    assert (data["lr"], data["schedule"], data["warmup_steps"], data["decay_fraction"]) == (3e-4, "wsd", 1, 0.5)
    assert data["lengths"] == [256] and data["length_spread"] == 0.05
    kinds = sorted([x["train"] for x in r["segments"]] for r in records)
    assert kinds == [[False, False, True], [False, True]]  # the copy: span, text, the span again (trained)
    copy = next(r["segments"] for r in records if len(r["segments"]) == 3)
    assert copy[0]["text"] == copy[2]["text"] and len(copy[2]["text"]) > 40
    phase = json.loads((out / "summary.json").read_text())["retrieval_phase"]
    for arm in ("full", "fmsa"):
        assert phase[arm]["done"] and phase[arm]["tokens"] == 2 * 256 and phase[arm]["final_eval_loss"] > 0
        assert set(phase[arm]["retrieval"]) == {"passkey", "single_needle"}
    assert phase["data"] == data
    # study C's models are columns of the from-scratch heatmap, beside study A's
    from msa_train.quality import plots
    drawn = {}
    with monkeypatch.context() as mp:
        mp.setattr(plots, "write_heatmap", lambda results, path, title="": drawn.update({Path(path).name: list(results)}))
        main(["report", "--work", str(work), "--out", str(out), "--tiny"])
    assert drawn["retrieval_from_scratch.png"] == ["full", "fmsa", "full after study C", "fmsa after study C"]
    assert not (out / "retrieval_phase.png").exists()
    # the phase's documents are written for its steps, lengths and questions: other values are refused
    with pytest.raises(ValueError, match=r"steps=3: .* was written for steps=2"):
        main(["study-c", "--work", str(work), "--out", str(out), "--tiny", "--retrieval-phase", "3"])
    with pytest.raises(ValueError, match=r"lengths=\[128\], tokens_per_question=128: .* written for lengths=\[256\], "
                                         r"tokens_per_question=0"):
        main(["study-c", "--work", str(work), "--out", str(out), "--tiny", "--retrieval-phase", "2",
              "--retrieval-phase-lengths", "128", "--retrieval-phase-questions", "128"])
    with pytest.raises(ValueError, match=r"length_spread=0.0: .* written for length_spread=0.05"):
        main(["study-c", "--work", str(work), "--out", str(out), "--tiny", "--retrieval-phase", "2",
              "--retrieval-phase-spread", "0"])
    # and for its training settings: the two arms train alike
    with pytest.raises(ValueError, match=r"decay_fraction=0.25: .* written for decay_fraction=0.5"):
        main(["study-c", "--work", str(work), "--out", str(out), "--tiny", "--retrieval-phase", "2",
              "--retrieval-phase-decay", "0.25"])
    with pytest.raises(ValueError, match=r"schedule=constant: .* written for schedule=wsd"):
        main(["study-c", "--work", str(work), "--out", str(out), "--tiny", "--retrieval-phase", "2",
              "--retrieval-phase-schedule", "constant"])
    for bad in (["--retrieval-phase-lengths", "128,x"], ["--retrieval-phase-lengths", "4096"],
                ["--retrieval-phase-lengths", "250"],  # 250 * 1.05 > 254, the tiny sequence less BOS/EOS
                ["--retrieval-phase-spread", "1"], ["--retrieval-phase-spread", "-0.1"],
                ["--retrieval-phase-questions", "-1"], ["--retrieval-phase-lr", "0"], ["--retrieval-phase-copies", "1"],
                ["--retrieval-phase-decay", "0"], ["--retrieval-phase-decay", "1.5"],
                ["--retrieval-phase-decay", "0.3", "--retrieval-phase-schedule", "constant"]):
        with pytest.raises(SystemExit, match=bad[0]):
            main(["study-c", "--work", str(work), "--tiny", "--retrieval-phase", "2", *bad])
    with pytest.raises(SystemExit):  # argparse: study-c needs --retrieval-phase
        main(["study-c", "--work", str(work), "--tiny"])
