"""Fixtures of the data tests: the byte tokenizer and writers of small local files."""
import json

import pytest

from msa_train.data import byte_tokenizer


@pytest.fixture(scope="session")
def tok():
    return byte_tokenizer()


@pytest.fixture
def write_jsonl(tmp_path):
    """write_jsonl(name, rows): rows are dicts (dumped) or raw strings (written as they are)."""
    def write(name, rows):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
        return str(path)
    return write
