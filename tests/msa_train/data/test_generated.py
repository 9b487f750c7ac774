import re

from msa_train.data import DataConfig, generate_corpus


def _cfg(seed=0):
    return DataConfig(num_docs=12, min_doc_tokens=800, max_doc_tokens=3000, seed=seed)


def test_generated_corpus_is_deterministic():
    a, b = generate_corpus(_cfg()), generate_corpus(_cfg())
    assert a == b
    assert generate_corpus(_cfg(seed=1)) != a


def test_generated_lengths_follow_config():
    docs = generate_corpus(_cfg())
    assert len(docs) == 12
    assert all(800 <= len(d) <= 3000 for d in docs)
    assert all(d.isascii() for d in docs)  # one byte-tokenizer token per character


def test_generated_queries_need_long_range_recall():
    """Every query restates a fact defined earlier in the same document, often far back."""
    distances = []
    for doc in generate_corpus(_cfg()):
        facts = {m.group(1): (m.group(2), m.start()) for m in re.finditer(r"let (\w{4}) = (\d{4})\.", doc)}
        for m in re.finditer(r"ask (\w{4}) : (\d{4})\.", doc):
            value, defined_at = facts[m.group(1)]
            assert value == m.group(2) and defined_at < m.start()
            distances.append(m.start() - defined_at)
        notes = dict(re.findall(r"note (\d+) : (\w+)\.", doc))
        for i, s in re.findall(r"recall (\d+) : (\w+)\.", doc):
            assert notes[i] == s
    assert len(distances) > 50
    assert sorted(distances)[len(distances) // 2] > 300  # median distance: hundreds of tokens
