"""Pretraining records that train only some of their text: ``{"segments": [{"text", "train"}]}``."""
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from msa_train.data import IGNORE_INDEX, DataConfig, DataValidationError, build_packed_dataset


def _docs(ds, tok):
    """(ids, labels) of every document of every packed sequence (padding left out)."""
    out = []
    for i in range(len(ds)):
        item = ds[i]
        cu = item["cu_seqlens"].tolist()
        for s, e in zip(cu[:-1], cu[1:]):
            if item["input_ids"][s] == tok.bos_token_id:
                out.append((item["input_ids"][s:e].tolist(), item["labels"][s:e].tolist()))
    return sorted(out)


def _trained(tok, ids, labels):
    """The trained text, a masked run between two trained ones written '|'."""
    runs, cur = [], []
    for x, y in zip(ids, labels):
        if y == IGNORE_INDEX:
            if cur:
                runs.append(tok.decode(cur))
            cur = []
        else:
            assert y == x  # labels are the tokens themselves, shifted inside the loss
            cur.append(x)
    return "|".join(runs + ([tok.decode(cur)] if cur else []))


def test_only_the_train_segments_are_trained(tok, write_jsonl):
    path = write_jsonl("d.jsonl", [
        {"segments": [{"text": "The key is 42. ", "train": False}, {"text": "Key?", "train": False},
                      {"text": " 42", "train": True}, {"text": " Again?", "train": False}, {"text": " 42", "train": True}]},
        {"segments": [{"text": "Q", "train": False}, {"text": "A", "train": True}, {"text": " tail", "train": False}]},
        {"text": "plain"}])
    docs = _docs(build_packed_dataset(DataConfig(format="pretrain", path=path), tok, 128), tok)
    by_text = {tok.decode(ids[1:]): (ids, labels) for ids, labels in docs}
    ids, labels = by_text["The key is 42. Key? 42 Again? 42" + tok.eos_token]
    assert labels[0] == IGNORE_INDEX and _trained(tok, ids, labels) == " 42| 42" + tok.eos_token  # EOS after a trained end
    ids, labels = by_text["QA tail" + tok.eos_token]
    assert _trained(tok, ids, labels) == "A"  # the last segment is context: its EOS is not trained
    ids, labels = by_text["plain" + tok.eos_token]
    assert _trained(tok, ids, labels) == "plain" + tok.eos_token  # a text record trains whole, as before


def test_segments_field_is_configurable_and_read_from_parquet(tok, tmp_path):
    rows = [{"parts": [{"text": "ctx ", "train": False}, {"text": "ans", "train": True}], "doc": None},
            {"parts": None, "doc": "x y"}]  # a table of both kinds: the other field null
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    cfg = DataConfig(format="pretrain", path=str(tmp_path / "a.parquet"), text_field="doc", segments_field="parts")
    docs = _docs(build_packed_dataset(cfg, tok, 64), tok)
    assert sorted(_trained(tok, *d) for d in docs) == sorted(["ans" + tok.eos_token, "x y" + tok.eos_token])


def test_a_table_of_both_kinds_leaves_the_other_field_empty(tok, tmp_path):
    """As pandas and HF write them: text rows with segments [] and segment rows with text "", and a
    struct column whose rows have every key any row has (null where a row lacks it)."""
    rows = [{"doc": "", "parts": [{"text": "ctx ", "train": False, "note": "x"}, {"text": "ans", "train": True,
                                                                               "note": None}]},
            {"doc": "x y", "parts": []}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    cfg = DataConfig(format="pretrain", path=str(tmp_path / "a.parquet"), text_field="doc", segments_field="parts")
    with pytest.raises(DataValidationError, match=r"a.parquet:row 0: parts\[0\] must be an object .* unknown keys \['note'\]"):
        build_packed_dataset(cfg, tok, 64)  # a real extra key is named; the nulls pyarrow adds are not
    rows[0]["parts"][0]["note"] = None
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    docs = _docs(build_packed_dataset(cfg, tok, 64), tok)
    assert sorted(_trained(tok, *d) for d in docs) == sorted(["ans" + tok.eos_token, "x y" + tok.eos_token])


@pytest.mark.parametrize("record, reason", [
    ({"text": "t", "segments": [{"text": "a", "train": True}]}, "has both 'text' (a document trained whole) and 'segments'"),
    ({"segments": []}, "field 'segments' must be a non-empty list of {text, train}, got list"),
    ({"segments": "abc"}, "field 'segments' must be a non-empty list of {text, train}, got str"),
    ({"segments": [{"text": "a"}]}, "segments[0] must be an object with 'text' (a string) and 'train' (true or "
                                    "false); it lacks ['train']"),
    ({"segments": [{"text": "a", "train": True, "w": 2}]}, "segments[0] must be an object with 'text' (a string) and "
                                                          "'train' (true or false); unknown keys ['w']"),
    ({"segments": ["a"]}, "segments[0] must be an object with 'text' (a string) and 'train' (true or false), got str"),
    ({"segment": [{"text": "a", "train": True}]}, "missing field 'text' (or 'segments': [{text, train}, ...]) "
                                                  "(record has: segment)"),
    ({"segments": [{"text": 3, "train": True}]}, "segments[0].text must be a string, got int"),
    ({"segments": [{"text": "a", "train": 1}]}, "segments[0].train must be true or false, got 1"),
    ({"segments": [{"text": "a", "train": False}, {"text": " ", "train": True}]},
     "field 'segments' has no non-empty segment with train true"),
    ({"segments": [{"text": "", "train": True}]}, "field 'segments' holds no text"),
], ids=["both", "empty", "string", "no-train", "extra-key", "item-string", "typo", "text-int", "train-int",
        "nothing-trained", "no-text"])
def test_malformed_segment_records_are_named(record, reason, tok, write_jsonl):
    path = write_jsonl("d.jsonl", [{"text": "good"}, record])
    with pytest.raises(DataValidationError) as e:
        build_packed_dataset(DataConfig(format="pretrain", path=path), tok, 64)
    assert f"d.jsonl:2: {reason}" in str(e.value)


def test_the_tokenisation_cache_key_carries_the_labels_version(tok, monkeypatch):
    """datasets fingerprints a function by its name, not its code: a release that changes the labels
    raises LABELS_VERSION so that no cached tokenisation of the old labels is reused."""
    import datasets

    from msa_train.data import tokenization

    records = datasets.Dataset.from_dict({"text": ["a b"], "segments": [[]]})
    first = tokenization.tokenize_dataset(records, "pretrain", tok)._fingerprint
    assert tokenization.tokenize_dataset(records, "pretrain", tok)._fingerprint == first
    monkeypatch.setattr(tokenization, "LABELS_VERSION", tokenization.LABELS_VERSION + 1)
    assert tokenization.tokenize_dataset(records, "pretrain", tok)._fingerprint != first
