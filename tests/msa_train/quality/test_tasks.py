"""RULER-style probes (msa_train/quality/tasks.py) on the real text and BPE tokenizer of the tiny corpus."""
import json
import random
import re

import pytest
import torch

from msa_train.quality.tasks import (TASKS, Haystack, depth_grid, make_probe, pack_probes, probe_grid,
                                     retrieval_table, training_document, training_records)


@pytest.fixture(scope="module")
def hay(tiny_corpus):
    from transformers import PreTrainedTokenizerFast

    _, corpus, _ = tiny_corpus
    tok = PreTrainedTokenizerFast.from_pretrained(str(corpus / "tokenizer"))
    docs = [json.loads(line)["text"] for line in (corpus / "heldout.jsonl").read_text().splitlines()]
    return tok, Haystack([tok(d, add_special_tokens=False)["input_ids"] for d in docs], tok)


def oracle(task: str, prompt: str) -> str:
    """Answers the question from the prompt text alone, as a reader would."""
    if task == "passkey":
        return " " + re.search(r"The pass key is (\d+)\.", prompt).group(1)
    if task in ("single_needle", "multi_key"):
        key = re.search(r"What is the special magic number for ([\w-]+)\?", prompt).group(1)
        return " " + re.search(rf"magic numbers for {key} is: (\d+)\.", prompt).group(1)
    if task == "multi_value":
        key = re.search(r"What are all the special magic numbers for ([\w-]+),", prompt).group(1)
        return ",".join(" " + v for v in re.findall(rf"magic numbers for {key} is: (\d+)\.", prompt))
    value = re.search(r"assigned the value (\d+)\?", prompt).group(1)
    held, found = {value}, []
    for name, rhs in re.findall(r"VAR ([A-Z]{5}) = (?:VAR )?([A-Z]{5}|\d+)\.", prompt):
        if rhs in held:
            held.add(name)
            found.append(" " + name)
    return "".join(found)


def _occurrences(ids, sub):
    return [i for i in range(len(ids) - len(sub) + 1) if ids[i:i + len(sub)] == sub]


@pytest.mark.parametrize("task", TASKS)
def test_probe_answer_recoverable_at_its_depth_and_nowhere_else(hay, task):
    tok, haystack = hay
    length, k = 1400, 0
    for depth in (0.0, 0.3, 1.0):
        p = make_probe(task, tok, haystack, length, depth, random.Random(f"t/{task}/{depth}"), bos_id=tok.bos_token_id)
        ids, labels, n = p["input_ids"].tolist(), p["labels"], p["answer_tokens"]
        assert len(ids) == length and ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
        assert (labels[:-n] == -100).all() and labels[-n:].tolist() == ids[-n:]
        prompt = tok.decode(ids[1:-n])
        assert oracle(task, prompt) == p["answer"] == tok.decode(ids[-n:])
        # the main needle lies at its depth of the haystack: exactly, up to the needles placed before it
        before = sum(n_ for a, n_ in zip(p["needle_at"][1:], p["needle_len"][1:]) if a < p["needle_at"][0])
        offset = p["needle_at"][0] - p["prefix"] - before
        assert abs(offset - depth * p["free"]) <= 1
        # every value's tokens occur only inside the planted needles, the question and the answer
        needle_ends = [a + n_ for a, n_ in zip(p["needle_at"], p["needle_len"])]
        for value in set(re.findall(r"\d{5,}|[A-Z]{5}", p["answer"] + prompt[-200:])):
            sub = tok(" " + value, add_special_tokens=False)["input_ids"]
            for at in _occurrences(ids, sub):
                assert at >= p["question_at"] or any(a <= at < e for a, e in zip(p["needle_at"], needle_ends)), value
            k += 1
    assert k >= 3


def test_grid_is_seeded_per_cell_and_too_short_is_refused(hay):
    tok, haystack = hay
    a = probe_grid(["passkey", "single_needle"], tok, haystack, [600, 800], depth_grid(3), 2, seed="eval")
    assert len(a) == 2 * 2 * 3 * 2 and depth_grid(3) == [0.0, 0.5, 1.0] and depth_grid(1) == [0.5]
    b = probe_grid(["single_needle"], tok, haystack, [800], depth_grid(3), 2, seed="eval")
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a[18:], b))  # same cell, same probes
    c = probe_grid(["single_needle"], tok, haystack, [800], depth_grid(3), 2, seed="train")
    assert not torch.equal(c[0]["input_ids"], b[0]["input_ids"])
    texts = training_records(["passkey"], tok, haystack, [600], 3, seed="study", answers_only=False)
    assert len(texts) == 3 and all("The pass key is" in t["text"] for t in texts)
    with pytest.raises(ValueError, match="fixed text takes"):
        make_probe("multi_key", tok, haystack, 64, 0.5, random.Random(0))
    with pytest.raises(ValueError, match="unknown task"):
        probe_grid(["needle"], tok, haystack, [600], [0.5], 1, seed="x")


def test_training_document_asks_many_questions_each_with_one_answer(hay):
    tok, haystack = hay
    rng = random.Random(3)
    for length, queries in [(1600, 3), (3200, 6)]:
        d = training_document(list(TASKS), tok, haystack, length, queries, rng)
        ids = d["input_ids"].tolist()
        assert len(ids) == length and len(d["question_at"]) == queries == len(d["answers"])
        assert sorted(d["needle_at"]) == d["needle_at"] or len(set(d["needle_at"])) == len(d["needle_at"])
        ends = d["question_at"][1:] + [length]
        assert d["question_at"][0] > max(d["needle_at"])  # every needle before the first question
        body = tok.decode(ids[:d["question_at"][0]])
        labelled = (d["labels"] != -100).nonzero().flatten().tolist()
        want = []
        for at, answer, end in zip(d["question_at"], d["answers"], ends):
            assert ids[end - len(answer):end] == answer  # the answer closes its question
            want += list(range(end - len(answer), end))
            q = tok.decode(ids[at:end - len(answer)])
            task = ("passkey" if "pass key" in q else "multi_value" if "What are all" in q else
                    "variable_tracking" if "Question: which" in q else "single_needle")
            assert oracle(task, body + q) == tok.decode(answer), (task, q)  # the reader's answer is the label
        assert labelled == want and body.count("The pass key is") <= 1
    starts = {tuple(haystack.window(random.Random(i), 8, anywhere=True)) for i in range(40)}
    assert len(starts) > len(haystack.starts)  # training haystacks start anywhere, not at a few document starts
    text = training_records(list(TASKS), tok, haystack, [2400], 2, seed="study", tokens_per_query=800, max_queries=3,
                            answers_only=False)
    assert all(t["text"].count("?") >= 3 for t in text)
    with pytest.raises(ValueError, match="fixed text takes"):
        training_document(list(TASKS), tok, haystack, 300, 8, rng)
    with pytest.raises(ValueError, match="at most once"):
        training_document(["passkey"], tok, haystack, 1000, 2, rng)


def test_pack_probes_and_table(hay):
    tok, haystack = hay
    probes = probe_grid(["passkey"], tok, haystack, [300, 500], [0.0, 1.0], 1, seed="eval")
    packs = pack_probes(probes, 1000, pad_id=tok.pad_token_id)
    assert [p["probe_ids"] for p in packs] == [[0, 1], [2, 3]]
    first = packs[0]
    assert first["cu_seqlens"].tolist() == [0, 300, 600, 1000] and first["num_segments"] == 3
    assert first["segments"].tolist() == [0] * 300 + [1] * 300 + [2] * 400
    assert torch.equal(first["input_ids"][300:600], probes[1]["input_ids"])
    assert first["position_ids"][300].item() == 0 and (first["labels"][600:] == -100).all()
    # each probe's first answer token, where its labels start
    answer_at = [300 - probes[0]["answer_tokens"], 600 - probes[1]["answer_tokens"]]
    assert first["answer_at"].tolist() == answer_at and (first["labels"][torch.tensor(answer_at) - 1] == -100).all()
    bad = dict(probes[0], labels=torch.full_like(probes[0]["labels"], -100))
    with pytest.raises(ValueError, match="probe 0 needs an answer after some prompt.*no labels"):
        pack_probes([bad], 1000, pad_id=tok.pad_token_id)
    table = retrieval_table(probes, [True, False, True, True])
    assert table == {"passkey": {"300": {"0": 1.0, "1": 0.0}, "500": {"0": 1.0, "1": 1.0}}}


def test_answers_only_training_records_train_exactly_the_answers(hay, tmp_path):
    """Synthetic documents as segment records: the data pipeline trains their answers (and the EOS
    after the last) and nothing else, and their text is that of the same documents trained whole."""
    from msa_train.data import IGNORE_INDEX, DataConfig, build_packed_dataset

    tok, haystack = hay
    kw = dict(tokens_per_query=400, max_queries=3, seed="study")
    records = training_records(list(TASKS), tok, haystack, [1200], 2, **kw)
    whole = training_records(list(TASKS), tok, haystack, [1200], 2, answers_only=False, **kw)
    rng = random.Random("train-mix/study")
    for rec, plain in zip(records, whole):
        rng.choice([1200])
        doc = training_document(list(TASKS), tok, haystack, 1200, 3, rng)
        segs = rec["segments"]
        assert "".join(x["text"] for x in segs) == plain["text"]
        assert [x["text"] for x in segs if x["train"]] == [tok.decode(a) for a in doc["answers"]]
        assert segs[-1]["train"] and not segs[0]["train"]
    path = tmp_path / "mix.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    ds = build_packed_dataset(DataConfig(format="pretrain", path=str(path)), tok, 1400)
    got = []
    for i in range(len(ds)):  # one document a sequence, in packing's order
        labels, ids = ds[i]["labels"], ds[i]["input_ids"]
        trained = labels != IGNORE_INDEX
        assert torch.equal(labels[trained], ids[trained])
        assert trained.sum() < 0.1 * (ids != tok.pad_token_id).sum()
        got.append(tok.decode(ids[trained]))
    assert sorted(got) == sorted("".join(x["text"] for x in r["segments"] if x["train"]) + tok.eos_token
                                 for r in records)


def test_copy_records_repeat_a_span_of_text_and_train_only_the_repeat(hay, tmp_path):
    """A copy document is a span of real text, more text, the span again; through the data pipeline
    only the repeat trains (and the EOS after it), and its tokens are those of the first copy, which
    occurs once before it: copying from there predicts every trained token but the first."""
    from msa_train.data import IGNORE_INDEX, DataConfig, build_packed_dataset
    from msa_train.quality.tasks import copy_records

    tok, haystack = hay
    records = copy_records(tok, haystack, [256, 384], 6, seed="t")
    assert records == copy_records(tok, haystack, [256, 384], 6, seed="t")  # seeded
    assert all([x["train"] for x in r["segments"]] == [False, False, True] for r in records)
    path = tmp_path / "copies.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    ds = build_packed_dataset(DataConfig(format="pretrain", path=str(path)), tok, 512)
    assert len(ds) == 6
    for i in range(len(ds)):
        labels, ids = ds[i]["labels"], ds[i]["input_ids"]
        trained = (labels != IGNORE_INDEX).nonzero().flatten().tolist()[:-1]  # the EOS after the document trains too
        n = int((ids != tok.pad_token_id).sum())
        assert 256 // 4 - 8 <= len(trained) <= n // 2 + 8 and trained == list(range(trained[0], trained[-1] + 1))
        repeat, before = ids[trained[0]:trained[-1] + 1].tolist(), ids[:trained[0]].tolist()
        hits = [j for j in range(len(before) - len(repeat) + 1) if before[j:j + len(repeat)] == repeat]
        assert len(hits) == 1 and hits[0] <= 1, (i, hits)  # at the start (after BOS, where the recipe adds one)


def test_draw_length_spreads_each_length_and_without_a_spread_draws_as_before():
    from msa_train.quality.tasks import draw_length

    a, b = random.Random(3), random.Random(3)
    assert [draw_length(a, [256, 512, 2048]) for _ in range(50)] == [b.choice([256, 512, 2048]) for _ in range(50)]
    assert a.random() == b.random()  # no draw beyond the choice: the study's mix is unchanged
    rng = random.Random(4)
    got = [draw_length(rng, [256, 2048], 0.125) for _ in range(4000)]
    short, long = [n for n in got if n < 1000], [n for n in got if n >= 1000]
    assert min(short) == 224 and max(short) == 288 and min(long) == 1792 and max(long) == 2304
    assert len(set(short)) == 65 and abs(sum(short) / len(short) - 256) < 2  # every length, centred
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match=f"spread {bad}: expected a fraction in"):
            draw_length(rng, [256], bad)


def test_spread_records_vary_their_length(hay):
    """Retrieval and copy documents with a spread: their lengths vary around each given length, within it."""
    from msa_train.quality.tasks import copy_records

    tok, haystack = hay
    tasks = ["passkey", "single_needle", "multi_key"]
    records = training_records(tasks, tok, haystack, [1024], 40, seed="s", spread=0.125)
    sizes = [len(tok("".join(x["text"] for x in r["segments"]), add_special_tokens=False)["input_ids"])
             for r in records]
    assert 896 - 8 <= min(sizes) < 940 and 1100 < max(sizes) <= 1152 + 8, sizes
    assert training_records(tasks, tok, haystack, [1024], 40, seed="s", spread=0.125) == records  # seeded
    copies = copy_records(tok, haystack, [1024], 40, seed="s", spread=0.125)
    assert len({len("".join(x["text"] for x in r["segments"])) for r in copies}) > 30
