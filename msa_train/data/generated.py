"""A deterministic corpus of long documents with long-range structure.

Sparse attention only has something to learn when predicting a token needs a key far
back in the document. Each generated document therefore mixes three kinds of lines:

- facts, all defined in the document's first part: ``let kqzd = 4821.``
- queries, spread over the rest, that restate a fact defined far earlier:
  ``ask kqzd : 4821.`` The value is predictable only by looking it up.
- copy pairs: ``note 7 : <random string>.`` early, ``recall 7 : <same string>.`` late.

between filler prose from a small word list (locally predictable, so the loss also
falls early in training). Documents are ASCII, so with the byte-level tokenizer one
character is one token and the lengths below are token counts.
"""
from __future__ import annotations

import random
import string

from .config import DataConfig

_WORDS = (
    "the a of to and in that is was he for it with as his on be at by had are but from or have an they "
    "which one you were her all she there would their we him been has when who will more no if out so said "
    "what up its about into than them can only other new some could time these two may then do first any my "
    "now such like our over man me even most made after also did many before must through back years where "
    "much your way well down should because each just those people how too little state good very make world "
    "still own see men work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three"
).split()


def _key(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(4))


def _filler(rng: random.Random, n_words: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(n_words)]
    return " ".join(words).capitalize() + ".\n"


def _document(rng: random.Random, length: int) -> str:
    """One document of exactly ``length`` characters (the last line may be cut short)."""
    n_facts = max(2, length // 256)
    facts = {}
    while len(facts) < n_facts:
        facts[_key(rng)] = f"{rng.randrange(10_000):04d}"
    copies = ["".join(rng.choice(string.ascii_letters + string.digits) for _ in range(rng.randint(12, 32)))
              for _ in range(max(1, length // 1024))]

    # The first quarter defines everything; the rest queries it, so every answer is
    # at least a few hundred tokens away from its definition.
    head = [f"let {k} = {v}.\n" for k, v in facts.items()]
    head += [f"note {i} : {s}.\n" for i, s in enumerate(copies)]
    rng.shuffle(head)
    lines: list[str] = []
    for line in head:
        lines.append(line)
        lines.append(_filler(rng, rng.randint(3, 8)))
    body_len = sum(map(len, lines))
    queries = list(facts.items())
    recalls = list(enumerate(copies))
    while body_len < length:
        roll = rng.random()
        if roll < 0.3:
            k, v = rng.choice(queries)
            line = f"ask {k} : {v}.\n"
        elif roll < 0.4:
            i, s = rng.choice(recalls)
            line = f"recall {i} : {s}.\n"
        else:
            line = _filler(rng, rng.randint(4, 14))
        lines.append(line)
        body_len += len(line)
    return "".join(lines)[:length]


def generate_corpus(cfg: DataConfig) -> list[str]:
    """``cfg.num_docs`` documents, lengths uniform in [min_doc_tokens, max_doc_tokens] characters.

    Deterministic given ``cfg.seed``: the same config gives the same strings on any machine.
    The lengths exclude the BOS/EOS tokens that tokenisation adds.
    """
    rng = random.Random(cfg.seed)
    lengths = [rng.randint(cfg.min_doc_tokens, cfg.max_doc_tokens) for _ in range(cfg.num_docs)]
    return [_document(random.Random(f"{cfg.seed}/{i}"), n) for i, n in enumerate(lengths)]
