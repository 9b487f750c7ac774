"""RULER-style retrieval probes over a real-text haystack (docs/evaluation.md, docs/quality.md).

Every probe is one document of exactly ``length`` tokens:
``[bos] intro haystack... needle ... haystack ... question answer``. The haystack is a window of
real text (held-out documents, tokenised), the needles are short sentences tokenised on their own
and spliced in at token offsets, so a needle's depth is exact in tokens. Only the answer's tokens
carry labels: a probe is retrieved when every answer token is the model's top prediction
(teacher-forced exact match, which equals greedy decoding of the answer).

Every value that the question asks about is tokenised once, and the same tokens appear in the
needle and in the answer, so retrieving it is copying those tokens whatever the tokenizer. A
haystack window that happens to contain a needle's key or value is redrawn, so the answer
occurs only where it was planted.

Tasks (after RULER, Hsieh et al., 2024):

- ``passkey``: one 5-digit pass key (Mohtashami & Jaggi, 2023).
- ``single_needle``: one key -> 7-digit value statement; asked for the value of that key.
- ``multi_key``: the same, with three distractor statements (other keys, other values) at
  random depths.
- ``multi_value``: four values for one key (the first at the asked depth, the others later);
  asked for all of them, in the order they appear.
- ``variable_tracking``: ``VAR ABCDE = 12345`` at the asked depth, then a chain of three
  assignments ``VAR B = VAR A`` ... later; asked for every variable holding the value.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

IGNORE_INDEX = -100
TASKS = ("passkey", "single_needle", "multi_key", "multi_value", "variable_tracking")

_ADJECTIVES = ("amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen",
               "lunar", "mellow", "noble", "olive", "plain", "quiet", "rapid", "silver", "tidy", "upper", "vivid",
               "woven", "young", "zesty", "bold", "crisp", "deep", "early", "fresh")
_NOUNS = ("anchor", "badger", "canyon", "dagger", "ember", "falcon", "garden", "harbor", "island", "jacket",
          "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "ribbon", "saddle", "tunnel",
          "umbrella", "valley", "walnut", "yonder", "zephyr", "beacon", "cobalt", "domino", "engine", "fjord")
_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass
class Piece:
    """A needle to splice into the haystack: its tokens and the depth (0..1) of its first token."""
    ids: List[int]
    depth: float


@dataclass
class Plan:
    """What a task generator decides for one probe, before the haystack is laid out."""
    intro: str
    needles: List[Tuple[str, float]]   # (text, depth); values inside are written as {0}, {1}, ...
    question: str
    answer: str                        # written with the same {i} placeholders
    values: List[str]                  # the strings that {i} stand for, tokenised once each
    secrets: List[str]                 # strings that must not occur in the haystack window


def _encode(tokenizer, text: str) -> List[int]:
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def _key(rng: random.Random, taken: set) -> str:
    while True:
        k = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if k not in taken:
            taken.add(k)
            return k


def _number(rng: random.Random, digits: int, taken: set) -> str:
    while True:
        v = str(rng.randrange(10 ** (digits - 1), 10 ** digits))
        if v not in taken:
            taken.add(v)
            return v


def _later(rng: random.Random, depth: float, n: int) -> List[float]:
    """n increasing depths after ``depth`` (the rest of the haystack), for a task's later needles."""
    return sorted(depth + (1.0 - depth) * rng.random() for _ in range(n))


def _plan_passkey(rng, depth):
    v = _number(rng, 5, set())
    return Plan("A pass key is hidden somewhere in the long text below. Find it and keep it in mind.\n",
                [("\nThe pass key is{0}. Keep it in mind: that number is the pass key.\n", depth)],
                "\nWhat is the pass key? The pass key is", "{0}", [" " + v], [v])


_MAGIC_INTRO = "Some special magic numbers are hidden in the long text below. Memorise them.\n"


def _plan_single(rng, depth, distractors: int = 0):
    keys, nums = set(), set()
    key, v = _key(rng, keys), _number(rng, 7, nums)
    needles = [(f"\nOne of the special magic numbers for {key} is:{{0}}.\n", depth)]
    values, secrets = [" " + v], [key, v]
    for i in range(distractors):
        k, w = _key(rng, keys), _number(rng, 7, nums)
        needles.append((f"\nOne of the special magic numbers for {k} is:{{{i + 1}}}.\n", rng.random()))
        values.append(" " + w)
        secrets += [k, w]
    return Plan(_MAGIC_INTRO, needles, f"\nWhat is the special magic number for {key}? The special magic number "
                f"for {key} is:", "{0}", values, secrets)


def _plan_multi_value(rng, depth, n: int = 4):
    key, nums = _key(rng, set()), set()
    vs = [_number(rng, 7, nums) for _ in range(n)]
    depths = [depth] + _later(rng, depth, n - 1)
    needles = [(f"\nOne of the special magic numbers for {key} is:{{{i}}}.\n", d) for i, d in enumerate(depths)]
    answer = ",".join(f"{{{i}}}" for i in range(n))
    return Plan(_MAGIC_INTRO, needles, f"\nWhat are all the special magic numbers for {key}, in the order they "
                f"appear? The special magic numbers for {key} are:", answer, [" " + v for v in vs], [key, *vs])


def _plan_variables(rng, depth, hops: int = 3):
    names: List[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choice(_LETTERS) for _ in range(5))
        if name not in names:
            names.append(name)
    v = _number(rng, 5, set())
    depths = [depth] + _later(rng, depth, hops)
    needles = [("\nVAR{1} ={0}.\n", depths[0])]
    needles += [(f"\nVAR{{{i + 2}}} = VAR{{{i + 1}}}.\n", d) for i, d in enumerate(depths[1:])]
    answer = "".join(f"{{{i + 1}}}" for i in range(hops + 1))
    return Plan("Variables are assigned in the long text below. Track their values.\n", needles,
                f"\nQuestion: which variables are assigned the value {v}? Answer: the variables are", answer,
                [" " + v] + [" " + n for n in names], [v, *names])


PLANNERS: Dict[str, Callable[[random.Random, float], Plan]] = {
    "passkey": _plan_passkey,
    "single_needle": _plan_single,
    "multi_key": lambda rng, depth: _plan_single(rng, depth, distractors=3),
    "multi_value": _plan_multi_value,
    "variable_tracking": _plan_variables,
}


def check_tasks(tasks: Sequence[str], key: str = "eval.retrieval") -> None:
    unknown = [t for t in tasks if t not in PLANNERS]
    if unknown:
        raise ValueError(f"{key}: unknown task(s) {unknown}; choose from {list(TASKS)}")


def depth_grid(n: int) -> List[float]:
    """n depths evenly from 0 to 1 (0.5 for one)."""
    if n < 1:
        raise ValueError(f"depths: expected an integer >= 1, got {n}")
    return [0.5] if n == 1 else [round(i / (n - 1), 4) for i in range(n)]


class Haystack:
    """A token stream of real text to cut probe haystacks from (documents joined by a blank line).

    Args:
        token_docs: token ids of each document (e.g. held-out documents), in a fixed order.
        tokenizer: the tokenizer of those ids.
    """

    def __init__(self, token_docs: Sequence[Sequence[int]], tokenizer):
        sep = _encode(tokenizer, "\n\n")
        ids: List[int] = []
        self.starts: List[int] = []
        for doc in token_docs:
            self.starts.append(len(ids))
            ids += list(doc) + sep
        if not ids:
            raise ValueError("retrieval haystack: no documents")
        self.ids = torch.tensor(ids, dtype=torch.int64)
        self.tokenizer = tokenizer

    def window(self, rng: random.Random, n: int, anywhere: bool = False) -> List[int]:
        """n tokens starting at a random document start (wrapping around the stream), or with
        ``anywhere`` at any token: training documents take their haystacks anywhere, since a few
        dozen documents' starts would give hundreds of synthetic documents the same text."""
        total = len(self.ids)
        start = rng.randrange(total) if anywhere else rng.choice(self.starts)
        idx = (torch.arange(n) + start) % total
        return self.ids[idx].tolist()


def _fill(tokenizer, text: str, values: List[List[int]]) -> List[int]:
    """``text`` with ``{i}`` placeholders as tokens, each value its own tokens (tokenised once)."""
    out: List[int] = []
    rest = text
    while "{" in rest:
        head, _, tail = rest.partition("{")
        index, _, rest = tail.partition("}")
        out += (_encode(tokenizer, head) if head else []) + values[int(index)]
    return out + (_encode(tokenizer, rest) if rest else [])


def _layout(plans: Sequence[Plan], tokenizer, haystack: Haystack, length: int, rng: random.Random,
            bos_id: Optional[int], what: str, hint: str, max_tries: int = 20, anywhere: bool = False) -> Dict[str, Any]:
    """One document of exactly ``length`` tokens: the plans' intros, a haystack window with every
    plan's needles spliced in at their depths, then each plan's question and answer in turn."""
    intro: List[int] = []
    for text in dict.fromkeys(pl.intro for pl in plans):  # a repeated intro once
        intro += _encode(tokenizer, text)
    needles: List[Piece] = []
    qa: List[Tuple[List[int], List[int]]] = []
    for pl in plans:
        values = [_encode(tokenizer, v) for v in pl.values]
        needles += [Piece(_fill(tokenizer, t, values), d) for t, d in pl.needles]
        qa.append((_fill(tokenizer, pl.question, values), _fill(tokenizer, pl.answer, values)))
    bos = [bos_id] if bos_id is not None else []
    fixed = len(bos) + len(intro) + sum(len(p.ids) for p in needles) + sum(len(q) + len(a) for q, a in qa)
    free = length - fixed
    if free < 0:
        raise ValueError(f"{what}: its fixed text takes {fixed} tokens, more than its length {length}; {hint}")
    secrets = [s for pl in plans for s in pl.secrets]
    for _ in range(max_tries):
        hay = haystack.window(rng, free, anywhere)
        text = tokenizer.decode(hay)
        if not any(s in text for s in secrets):
            break
    else:
        raise ValueError(f"{what}: every haystack window drawn contains a key or value; use a larger haystack")
    # needles in the order of their depth; each goes in at its offset of the haystack
    order = sorted(range(len(needles)), key=lambda i: (needles[i].depth, i))
    ids, needle_at, last = bos + intro, [0] * len(needles), 0
    for i in order:
        cut = round(needles[i].depth * free)
        ids += hay[last:cut]
        needle_at[i] = len(ids)
        ids += needles[i].ids
        last = cut
    ids += hay[last:]
    labels = [IGNORE_INDEX] * len(ids)
    question_at = []
    for q, a in qa:
        question_at.append(len(ids))
        ids += q + a
        labels += [IGNORE_INDEX] * len(q) + a
    assert len(ids) == length, (len(ids), length)
    return {"input_ids": torch.tensor(ids, dtype=torch.int64), "labels": torch.tensor(labels, dtype=torch.int64),
            "needle_at": needle_at, "needle_len": [len(p.ids) for p in needles], "question_at": question_at,
            "answers": [a for _, a in qa], "free": free, "prefix": len(bos) + len(intro)}


def make_probe(task: str, tokenizer, haystack: Haystack, length: int, depth: float, rng: random.Random,
               bos_id: Optional[int] = None, max_tries: int = 20) -> Dict[str, Any]:
    """One probe of ``task`` of exactly ``length`` tokens, its main needle at ``depth`` of the haystack.

    Returns:
        ``input_ids`` / ``labels`` (int64 [length]; labels only on the answer, aligned with
        input_ids as in packing.py), ``answer_tokens``, ``needle_at`` / ``needle_len`` (token
        offset and length of every needle, in plan order: the first is the one at ``depth``), ``depth``, ``task``,
        ``answer`` (the answer's text).

    Raises:
        ValueError: ``length`` too short for the task's fixed text.
    """
    doc = _layout([PLANNERS[task](rng, depth)], tokenizer, haystack, length, rng, bos_id,
                  f"retrieval task {task}, a probe", "use longer eval.retrieval_lengths", max_tries)
    answer = doc.pop("answers")[0]
    doc.update(answer_tokens=len(answer), question_at=doc["question_at"][0], depth=depth, task=task,
               answer=tokenizer.decode(answer))
    return doc


def training_document(tasks: Sequence[str], tokenizer, haystack: Haystack, length: int, queries: int,
                      rng: random.Random) -> Dict[str, Any]:
    """A synthetic training document of ``length`` tokens that asks ``queries`` questions: the
    needles of ``queries`` probes (tasks drawn from ``tasks``, depths uniform) in one haystack, then
    every question with its answer, in random order. Many questions per document give the model
    many retrieval examples per synthetic token (one question per 2K-16K-token document, 3% of
    13M tokens, left both models of the first study run at 0% everywhere). No two probes share a
    key or a value, and the pass key is asked at most once, so every question has one answer.
    Returns what ``_layout`` returns."""
    check_tasks(tasks)
    if queries > 1 and list(tasks) == ["passkey"]:
        raise ValueError(f"a training document of {queries} questions: the pass key is asked at most once a document")
    plans: List[Plan] = []
    taken: set = set()
    while len(plans) < queries:
        task = rng.choice(list(tasks))
        if task == "passkey" and "passkey" in taken:  # "What is the pass key?" has one answer only once
            continue
        pl = PLANNERS[task](rng, rng.random())
        if taken.isdisjoint(pl.secrets):
            plans.append(pl)
            taken.update([task, *pl.secrets])
    rng.shuffle(plans)  # the questions' order; the needles go by depth
    return _layout(plans, tokenizer, haystack, length, rng, None, f"a training document of {queries} questions",
                   "use longer lengths or fewer questions", anywhere=True)


def probe_grid(tasks: Sequence[str], tokenizer, haystack: Haystack, lengths: Sequence[int], depths: Sequence[float],
               probes: int, seed: str, bos_id: Optional[int] = None) -> List[Dict[str, Any]]:
    """``probes`` probes per (task, length, depth) cell, each drawn from its own seeded stream
    (``seed``/task/length/depth/i), so a cell's probes do not depend on the rest of the grid."""
    check_tasks(tasks)
    out = []
    for task in tasks:
        for length in lengths:
            for depth in depths:
                for i in range(probes):
                    rng = random.Random(f"{seed}/{task}/{length}/{depth}/{i}")
                    out.append(make_probe(task, tokenizer, haystack, length, depth, rng, bos_id))
    return out


def pack_probes(probes: Sequence[Dict[str, Any]], pack_len: int, pad_id: int) -> List[Dict[str, Any]]:
    """Probes as packed sequences of ``pack_len`` tokens, each probe its own document (cu_seqlens),
    the tail padding another, so short probes share a forward. ``segment`` of every token is the
    index of its probe within the pack (padding: one past the last); ``probe_ids`` maps them back;
    ``answer_at`` (int64, one per probe) is the packed position of each probe's first answer token.

    Probes are placed in the given order, first fit into the current pack."""
    packs, cur = [], []

    def close():
        if not cur:
            return
        ids, labels, pos, seg, cu, answer_at = [], [], [], [], [0], []
        for j, p in enumerate(cur):
            n = len(p[1]["input_ids"])
            ids.append(p[1]["input_ids"]), labels.append(p[1]["labels"])
            trained = (p[1]["labels"] != IGNORE_INDEX).nonzero()
            if not len(trained) or int(trained[0]) == 0:
                raise ValueError(f"pack_probes: probe {p[0]} needs an answer after some prompt (labels from position >= 1), "
                                 f"got {'no labels' if not len(trained) else 'a label at position 0'}")
            answer_at.append(cu[-1] + int(trained[0]))
            pos.append(torch.arange(n)), seg.append(torch.full((n,), j))
            cu.append(cu[-1] + n)
        pad = pack_len - cu[-1]
        if pad:
            ids.append(torch.full((pad,), pad_id)), labels.append(torch.full((pad,), IGNORE_INDEX))
            pos.append(torch.arange(pad)), seg.append(torch.full((pad,), len(cur)))
            cu.append(pack_len)
        lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
        packs.append({"input_ids": torch.cat(ids).long(), "labels": torch.cat(labels).long(),
                      "position_ids": torch.cat(pos).long(), "segments": torch.cat(seg).long(),
                      "cu_seqlens": torch.tensor(cu, dtype=torch.int32), "max_seqlen": max(lengths),
                      "num_tokens": sum(len(p[1]["input_ids"]) for p in cur),
                      "num_segments": len(cur) + 1, "probe_ids": [p[0] for p in cur],
                      "answer_at": torch.tensor(answer_at, dtype=torch.int64)})
        cur.clear()

    used = 0
    for index, p in enumerate(probes):
        n = len(p["input_ids"])
        if n > pack_len:
            raise ValueError(f"pack_probes: a probe of {n} tokens does not fit pack_len={pack_len}")
        if used + n > pack_len:
            close()
            used = 0
        cur.append((index, p))
        used += n
    close()
    return packs


def retrieval_table(probes: Sequence[Dict[str, Any]], values: Sequence[float]) -> Dict[str, Dict[str, Dict[str, float]]]:
    """The mean of a per-probe value (exact match as a bool, a fraction of answer tokens, a loss) by
    task -> length -> depth (string keys, as JSON writes them)."""
    cells: Dict[Tuple[str, int, float], List[float]] = {}
    for p, v in zip(probes, values):
        cells.setdefault((p["task"], len(p["input_ids"]), p["depth"]), []).append(float(v))
    out: Dict[str, Dict[str, Dict[str, float]]] = {}
    for (task, length, depth), vs in cells.items():
        out.setdefault(task, {}).setdefault(str(length), {})[f"{depth:g}"] = sum(vs) / len(vs)
    return out


def questions_per_document(length: int, tokens_per_query: int = 0, max_queries: int = 1) -> int:
    """How many questions a synthetic training document of ``length`` tokens asks: one per
    ``tokens_per_query`` tokens, at least one and at most ``max_queries`` (one without ``tokens_per_query``)."""
    return max(1, min(max_queries, length // tokens_per_query)) if tokens_per_query else 1


def draw_length(rng: random.Random, lengths: Sequence[int], spread: float = 0.0) -> int:
    """A training document's length: one of ``lengths``, then, with ``spread``, uniform within that
    fraction of it either side. Without a spread every answer of a length sits at the same few
    positions, and a model learns those: on the CPU, a model trained on 254-token documents alone
    retrieved 23% of probes one token longer and 9-19% at 270-300 tokens, the same run on lengths
    from 226 to 254 91-100% from 180 to 300 (benchmarks/results/probes/results.md#trainer_path_variants).
    Spread 0 draws from ``rng`` exactly as before it existed (the study's mix stays the same)."""
    if not 0 <= spread < 1:
        raise ValueError(f"spread {spread}: expected a fraction in [0, 1)")
    n = rng.choice(list(lengths))
    return rng.randint(round(n * (1 - spread)), round(n * (1 + spread))) if spread else n


def training_records(tasks: Sequence[str], tokenizer, haystack: Haystack, lengths: Sequence[int], count: int,
                     seed: str, tokens_per_query: int = 0, max_queries: int = 1,
                     answers_only: bool = True, spread: float = 0.0) -> List[Dict[str, Any]]:
    """``count`` synthetic retrieval documents as pretraining records, for mixing into training
    data: a length per document from ``lengths`` (and ``spread``: :func:`draw_length`),
    ``questions_per_document`` questions in it, from
    a seed space of their own (``seed`` must differ from the evaluation's, so no training probe is
    an evaluation probe).

    ``answers_only`` (default): ``{"segments": [{"text", "train"}, ...]}`` records
    (msa_train/data/sources.py) whose answers are the only trained text, as in the evaluation's
    probes; the haystack, needles and questions are context. Otherwise ``{"text": ...}``, trained
    whole. Measured on a 1.3M-parameter model trained on these documents alone
    (benchmarks/results/probes/results.md#retrieval_probe): trained whole, the answers (1.8% of the
    tokens) were still at 8-11% of their tokens right after 24,000 questions; answers only, 97%
    exact match after 40,000."""
    check_tasks(tasks)
    rng = random.Random(f"train-mix/{seed}")
    out = []
    for _ in range(count):
        length = draw_length(rng, lengths, spread)
        queries = questions_per_document(length, tokens_per_query, max_queries)
        doc = training_document(tasks, tokenizer, haystack, length, queries, rng)
        ids = doc["input_ids"].tolist()
        if not answers_only:
            out.append({"text": tokenizer.decode(ids)})
            continue
        trained = (doc["labels"] != IGNORE_INDEX).tolist()
        cuts = [0] + [t for t in range(1, len(ids)) if trained[t] != trained[t - 1]] + [len(ids)]
        out.append({"segments": [{"text": tokenizer.decode(ids[a:b]), "train": trained[a]}
                                 for a, b in zip(cuts[:-1], cuts[1:])]})
    return out


def copy_document(rng: random.Random, haystack: Haystack, n: int,
                  random_vocab: int = 0) -> Tuple[List[int], List[int]]:
    """The two parts of an n-token copy document, drawn from ``rng``: the span S (a quarter to a
    half of n tokens, cut from ``haystack``, or with ``random_vocab`` uniform ids below it) and the
    filler of real text between its two copies; the document is S + filler + S."""
    s_len = rng.randint(n // 4, n // 2)
    if random_vocab:
        span = [rng.randrange(random_vocab) for _ in range(s_len)]
    else:
        span = haystack.window(rng, s_len, anywhere=True)
    return span, haystack.window(rng, n - 2 * s_len, anywhere=True)


def copy_records(tokenizer, haystack: Haystack, lengths: Sequence[int], count: int, seed: str,
                 spread: float = 0.0) -> List[Dict[str, Any]]:
    """``count`` copy documents as pretraining records for study C (lengths: :func:`draw_length`): a
    span S of real text (a quarter to a half of the document's length, from ``haystack``), more text,
    then S again; only S's
    second copy trains, so its trained tokens are predictable by finding the first copy and copying on
    (an induction head, which answering a needle's question also is: the question repeats the
    needle's words and the value follows them). Each copy is a segment of its own, so the data
    pipeline tokenises both alike; the repeat's first token trains too, though nothing predicts it.

    Measured on the CPU retrieval probe (benchmarks/results/probes/results.md#copy_documents): with
    half of every batch copy documents the retrieval phase change came at 1,750-2,250 steps in three
    seeds of three, and without them in none of three by 3,000; copies of random tokens taught
    nothing in 3,000 (one seed). In the study's sixth run the 169M-parameter dense model did not
    learn to copy in study C's 1,500 steps (same entry)."""
    rng = random.Random(f"train-copy/{seed}")
    out = []
    for _ in range(count):
        s, filler = copy_document(rng, haystack, draw_length(rng, lengths, spread))
        text = tokenizer.decode(s)
        out.append({"segments": [{"text": text, "train": False}, {"text": tokenizer.decode(filler), "train": False},
                                 {"text": text, "train": True}]})
    return out
