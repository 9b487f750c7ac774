"""The CPU retrieval probe (msa_train/quality/probe.py) at tiny sizes: its copy documents, its data
per step, its evaluation lines and its errors."""
import argparse
import json

import pytest
import torch

from msa_train.quality import probe


def _args(corpus, *extra):
    p = argparse.ArgumentParser()
    probe.add_arguments(p)
    return p.parse_args(["--corpus", str(corpus), "--probes", "2", "--batch", "4", *extra])


def test_copy_documents_train_only_the_repeat(tiny_corpus):
    _, corpus, _ = tiny_corpus
    p = probe._Probe(_args(corpus, "--copy-fraction", "0.5", "--lengths", "256"))
    for _ in range(5):
        x, y = p.copy_document(256)
        trained = (y != -100).nonzero().flatten()
        s_len = len(trained) + 1  # the repeat's first token is not a target
        assert len(x) == len(y) == 256 and 64 <= s_len <= 128
        assert trained.tolist() == list(range(256 - s_len + 1, 256))  # one contiguous tail
        assert x[:s_len].tolist() == x[-s_len:].tolist()                # S, filler, S
        assert y[-s_len + 1:].tolist() == x[-s_len + 1:].tolist()       # the targets are S's own tokens


def test_a_step_mixes_copies_and_questions_at_one_drawn_length(tiny_corpus):
    _, corpus, _ = tiny_corpus
    p = probe._Probe(_args(corpus, "--copy-fraction", "0.5", "--lengths", "256,384"))
    seen = set()
    for _ in range(8):
        x, y = p.batch()
        assert x.shape == y.shape and x.shape[0] == 4
        seen.add(x.shape[1])
        targets = (y != -100).sum(1)
        # two copy documents (a quarter to a half of the length trained), then two questions (answers only)
        assert all(t >= x.shape[1] // 4 - 1 for t in targets[:2].tolist())
        assert all(0 < t < 32 for t in targets[2:].tolist())
    assert seen == {256, 384}
    p = probe._Probe(_args(corpus, "--copy-fraction", "0.5", "--lengths", "384", "--spread", "0.125"))
    seen = {p.batch()[0].shape[1] for _ in range(12)}
    assert len(seen) > 6 and min(seen) >= 336 and max(seen) <= 432  # a length a step, within 12.5% of 384


def test_run_scores_every_eval_length_and_repeats_itself(tiny_corpus):
    _, corpus, _ = tiny_corpus
    args = _args(corpus, "--steps", "4", "--eval-every", "2", "--lengths", "256", "--eval-lengths", "256,512",
                 "--copy-fraction", "0.5", "--pretrain-steps", "2", "--pretrain-length", "384")
    emitted = []
    lines = probe.run(args, emit=emitted.append)
    assert [r["step"] for r in lines] == [2, 4] and json.loads(emitted[0])["phase"] == "pretrain"
    for r in lines:
        assert set(r) >= {"exact_256", "tokens_256", "exact_512", "tokens_512", "train_loss"}
        assert all(0.0 <= r[k] <= 1.0 for k in r if k.startswith(("exact_", "tokens_")))
    again = probe.run(args, emit=lambda _: None)
    assert [{k: v for k, v in r.items() if k != "s"} for r in again] == [{k: v for k, v in r.items() if k != "s"}
                                                                       for r in lines]


@pytest.mark.parametrize("extra, message", [(["--lengths", "12"], "--lengths 12"),
                                            (["--eval-lengths", "a,b"], "--eval-lengths a,b"),
                                            (["--lengths", "256", "--eval-lengths", "96"], "--eval-lengths 96: .*fixed text"),
                                            (["--copy-fraction", "1.0"], "--copy-fraction 1.0"),
                                            (["--spread", "1"], "--spread 1.0: expected a fraction")])
def test_bad_arguments_name_themselves(tiny_corpus, extra, message):
    _, corpus, _ = tiny_corpus
    with pytest.raises(SystemExit, match=message):
        probe._Probe(_args(corpus, *extra))


def test_a_directory_that_is_no_corpus_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="--corpus"):
        probe._Probe(_args(tmp_path))


def test_training_documents_too_short_for_their_questions_are_an_error_not_a_hang(tiny_corpus):
    _, corpus, _ = tiny_corpus
    p = probe._Probe(_args(corpus, "--lengths", "96", "--eval-lengths", "256"))
    with pytest.raises(SystemExit, match="--lengths 96: 100 training documents of 96 tokens"):
        p.batch()


def test_schedules(tiny_corpus):
    _, corpus, _ = tiny_corpus
    const = probe._Probe(_args(corpus, "--lengths", "256", "--steps", "100", "--warmup", "10"))
    cos = probe._Probe(_args(corpus, "--lengths", "256", "--steps", "100", "--warmup", "10", "--schedule", "cosine",
                             "--rope-theta", "500000"))
    f_const, f_cos = const.sched.lr_lambdas[0], cos.sched.lr_lambdas[0]
    assert [f_const(s) for s in (0, 9, 50, 99)] == pytest.approx([0.1, 1.0, 1.0, 1.0])
    assert [f_cos(s) for s in (0, 9, 10, 55, 100)] == pytest.approx([0.1, 1.0, 1.0, 0.55, 0.1])
    assert cos.model.config.rope_parameters["rope_theta"] == 500000.0


def test_the_nsa_probe_patches_the_same_model_and_trains(tiny_corpus):
    """--attention fmsa: the dense probe's model and initial weights, plus NSA's parameters at the
    given sizes; it trains and scores like the dense one (here on the CPU's PyTorch reference)."""
    _, corpus, _ = tiny_corpus
    dense = probe._Probe(_args(corpus, "--lengths", "256"))
    nsa = probe._Probe(_args(corpus, "--lengths", "256", "--attention", "fmsa", "--nsa-sizes", "16,8,16,4,32"))
    attn = nsa.model.model.layers[0].self_attn
    assert attn.nsa.sizes == dict(cmp_block=16, cmp_stride=8, slc_block=16, slc_topk=4, window=32)
    weights = dict(nsa.model.named_parameters())
    for name, w in dense.model.named_parameters():
        assert torch.equal(weights[name], w), name  # the same dense weights: NSA only adds its own
    assert any(".nsa." in name for name in weights)
    args = _args(corpus, "--steps", "2", "--eval-every", "2", "--lengths", "256", "--batch", "2",
                 "--attention", "fmsa", "--nsa-sizes", "16,8,16,4,32")
    (line,) = probe.run(args, emit=lambda _: None)
    assert line["attention"] == "fmsa" and line["nsa_sizes"] == "16,8,16,4,32" and line["train_loss"] > 0
    assert 0.0 <= line["exact_256"] <= 1.0
    assert len(line["needle_selected_256"]) == 4 and all(0.0 <= r <= 1.0 for r in line["needle_selected_256"])


def test_needle_selection_counts_the_blocks_that_hold_the_needle(tiny_corpus):
    """needle_selected: every layer's selection holds the needle where all of a 256-token probe's
    16 blocks are selected, and none does where the needle lies in none of the selected blocks."""
    _, corpus, _ = tiny_corpus
    every = probe._Probe(_args(corpus, "--lengths", "256", "--attention", "fmsa", "--nsa-sizes", "16,8,16,16,32"))
    assert every.needle_selected(256) == [1.0] * 4
    # three blocks: the initial and the two local ones. A needle said to lie three blocks before the
    # answer is in none of them; one said to lie in the first block is in every selection
    few = probe._Probe(_args(corpus, "--lengths", "256", "--attention", "fmsa", "--nsa-sizes", "16,8,16,3,32"))
    for q in few.probes[256]:
        q["needle_at"], q["needle_len"] = [int((q["labels"] != -100).nonzero()[0]) - 48], [1]
    assert few.needle_selected(256) == [0.0] * 4
    for q in few.probes[256]:
        q["needle_at"], q["needle_len"] = [15], [1]
    assert few.needle_selected(256) == [1.0] * 4


def test_bad_nsa_sizes_name_themselves(tiny_corpus):
    _, corpus, _ = tiny_corpus
    for sizes in ("16,8,16", "16,7,16,4,32"):
        with pytest.raises(SystemExit, match=f"--nsa-sizes {sizes}: expected"):
            probe._Probe(_args(corpus, "--attention", "fmsa", "--nsa-sizes", sizes))
