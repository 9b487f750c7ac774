"""Huge documents load in bounded memory: text files stream by line or paragraph, long texts are
tokenized in pieces with the ids of the whole, and a huge record gets a warning naming it."""
import logging
import random
import re

import pytest

from msa_train.data import sources, tokenization
from msa_train.data.config import DataConfig
from msa_train.data.sources import load_records
from tests.msa_train._util import REPO


def _regex_records(text: str, sample_by: str):
    """What reading the whole file and matching a pattern gives: the oracle of the streaming reader."""
    pattern = r"[^\n]+" if sample_by == "line" else r"\S[\s\S]*?(?=\n[ \t]*\n|\Z)"
    out, lineno, pos = [], 1, 0
    for m in re.finditer(pattern, text):
        lineno, pos = lineno + text.count("\n", pos, m.start()), m.start()
        if m.group().strip():
            out.append((lineno, m.group()))
    return out


@pytest.mark.parametrize("sample_by", ["line", "paragraph"])
def test_streamed_lines_and_paragraphs_match_the_whole_file_reading(tmp_path, sample_by):
    rng = random.Random(0)
    parts = ["alpha", "beta gamma", " ", "\t", "  lead", "x\t", "", "\r", "é ü", "end."]
    for trial in range(200):
        text = "".join(rng.choice(parts) + rng.choice(["\n", "\n", " ", "\n\n", "\n  \n", "\r\n", ""])
                       for _ in range(rng.randrange(1, 12)))
        path = tmp_path / f"{trial}.txt"
        path.write_bytes(text.encode())
        got = [(int(loc.rsplit(":", 1)[1]), rec["text"])
               for loc, rec, _ in sources._txt_records(str(path), sample_by, "text")]
        # the file is read with universal newlines, as the whole-file reading did
        assert got == _regex_records(text.replace("\r\n", "\n").replace("\r", "\n"), sample_by), repr(text)


def test_a_text_file_of_lines_is_not_read_whole(tmp_path, monkeypatch):
    path = tmp_path / "big.txt"
    path.write_text("one line\n" * 1000)
    class LinesOnly:  # the file as the reader gets it, without read()
        def __init__(self, *args, **kwargs):
            self.f = open(*args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def __iter__(self):
            return iter(self.f)

    monkeypatch.setattr(sources, "open", LinesOnly, raising=False)
    assert sum(1 for _ in sources._txt_records(str(path), "line", "text")) == 1000


def test_long_texts_are_tokenized_in_pieces_with_the_ids_of_the_whole(monkeypatch):
    from msa_train.quality.corpus import train_tokenizer

    docs = [p.read_text() for p in sorted((REPO / "docs").glob("*.md"))]
    tok = train_tokenizer(docs, 600)
    text = "\n\n".join(docs)[:40_000] + "no   spaces:" + "x" * 3000 + " tail"
    def ids_of(t):  # as _encode calls the tokenizer on document text
        return tok(t, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    whole = ids_of(text)
    longest = []
    call = type(tok).__call__

    def spy(self, texts, **kw):
        longest.append(max(map(len, texts)))
        return call(self, texts, **kw)

    monkeypatch.setattr(type(tok), "__call__", spy)
    monkeypatch.setattr(tokenization, "PIECE_CHARS", 2000)
    pieces = tokenization._pieces(text, 2000)
    assert "".join(pieces) == text and len(pieces) > 20
    ids = tokenization._encode(tok, ["short", text])
    assert max(longest) <= 2000
    # the cuts before a word give the whole text's ids; only the cut inside the 3000 x's may not
    differ = sum(a != b for a, b in zip(ids[1], whole)) + abs(len(ids[1]) - len(whole))
    assert ids[0] == ids_of("short") and differ <= 4
    assert tokenization._encode(tok, [text[:1500]]) == [ids_of(text[:1500])]


def test_a_huge_record_is_named_in_a_warning(tmp_path, monkeypatch, caplog):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "small"}\n{"text": "' + "word " * 400 + '"}\n')
    monkeypatch.setattr(sources, "HUGE_TEXT_CHARS", 1000)
    with caplog.at_level(logging.WARNING, logger="msa_train.data.sources"):
        ds, report = load_records(DataConfig(format="pretrain", path=str(path)))
    assert report.total == 2 and report.num_bad == 0
    warned = [r.getMessage() for r in caplog.records if "a record of" in r.getMessage()]
    assert len(warned) == 1 and f"{path}:2" in warned[0]
