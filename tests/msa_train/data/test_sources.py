"""Loading local files, and the reporting of malformed records."""
import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from msa_train.data import DataConfig, DataValidationError, build_packed_dataset
from msa_train.data.sources import load_records

DOCS = ["first document " * 5, "second one, a bit longer " * 7, "third"]


def _texts(ds, tok):
    """The documents of a packed dataset, decoded (BOS/EOS stripped), sorted."""
    out = []
    for i in range(len(ds)):
        item = ds[i]
        cu = item["cu_seqlens"].tolist()
        for s, e in zip(cu[:-1], cu[1:]):
            ids = item["input_ids"][s:e].tolist()
            if ids[0] == tok.bos_token_id:
                out.append(tok.decode(ids[1:-1]))
    return sorted(out)


@pytest.mark.parametrize("kind", ["jsonl", "json-array", "json-lines", "parquet", "directory"])
def test_pretrain_files_load(kind, tmp_path, tok, write_jsonl):
    rows = [{"text": d, "id": i} for i, d in enumerate(DOCS)]
    if kind == "jsonl":
        path = write_jsonl("a.jsonl", rows)
    elif kind == "json-array":
        path = tmp_path / "a.json"
        path.write_text(json.dumps(rows))
    elif kind == "json-lines":
        path = write_jsonl("a.json", rows)
    elif kind == "parquet":
        path = tmp_path / "a.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        write_jsonl("dir/sub/a.jsonl", rows[:1])
        pq.write_table(pa.Table.from_pylist(rows[1:]), tmp_path / "dir" / "b.parquet")
        path = tmp_path / "dir"
    ds = build_packed_dataset(DataConfig(format="pretrain", path=str(path)), tok, 256)
    assert _texts(ds, tok) == sorted(DOCS)
    assert ds.report.total == 3 and ds.report.num_bad == 0


@pytest.mark.parametrize("sample_by, expected", [
    ("document", ["alpha beta\ngamma\n\ndelta\n"]),
    ("paragraph", ["alpha beta\ngamma", "delta\n"]),
    ("line", ["alpha beta", "gamma", "delta"]),
])
def test_txt_files_load(sample_by, expected, tmp_path, tok):
    (tmp_path / "a.txt").write_text("alpha beta\ngamma\n\ndelta\n")
    ds = build_packed_dataset(DataConfig(format="pretrain", path=str(tmp_path / "a.txt"), text_sample_by=sample_by),
                              tok, 64)
    assert _texts(ds, tok) == sorted(expected)


def test_text_field_and_file_type_override(tmp_path, tok):
    path = tmp_path / "data.dump"
    path.write_text(json.dumps({"body": "hello"}) + "\n")
    ds = build_packed_dataset(DataConfig(format="pretrain", path=str(path), file_type="jsonl", text_field="body"),
                              tok, 32)
    assert _texts(ds, tok) == ["hello"]


def test_cache_dir_reuses_and_notices_edits(tmp_path, tok, write_jsonl):
    path = write_jsonl("a.jsonl", [{"text": "one"}, {"text": "two"}])
    cfg = DataConfig(format="pretrain", path=path, cache_dir=str(tmp_path / "cache"))
    assert _texts(build_packed_dataset(cfg, tok, 32), tok) == ["one", "two"]
    assert any((tmp_path / "cache").rglob("*.arrow"))
    write_jsonl("a.jsonl", [{"text": "one"}, {"text": "two"}, "{broken"])
    with pytest.raises(DataValidationError, match="a.jsonl:3: invalid JSON"):
        build_packed_dataset(cfg, tok, 32)


BAD_ROWS = [
    {"text": "good 1"},
    "{not json",
    {"text": ""},
    {"txt": "wrong field"},
    {"text": 42},
    ["a", "list"],
    {"text": "good 2"},
    {"text": "good 3"},
]
BAD_REASONS = [":2: invalid JSON", ":3: field 'text' is empty",
               ":4: missing field 'text' (or 'segments': [{text, train}, ...]) (record has: txt)",
               ":5: field 'text' must be a string, got int", ":6: expected a JSON object, got list"]


def test_malformed_records_fail_above_threshold_with_file_and_line(tok, write_jsonl):
    path = write_jsonl("bad.jsonl", BAD_ROWS)
    with pytest.raises(DataValidationError) as e:
        build_packed_dataset(DataConfig(format="pretrain", path=path, max_bad_fraction=0.5), tok, 64)
    msg = str(e.value)
    assert "5 of 8 records (62.50%) are malformed" in msg and "data.max_bad_fraction=0.5" in msg
    for reason in BAD_REASONS:
        assert f"{path}{reason}" in msg, (reason, msg)


@pytest.mark.parametrize("rows, fmt, group", [
    ([{"prompt": "Q", "response": "A"}] * 3, "preference", "data=sft"),
    ([{"prompt": "Q", "chosen": "A", "rejected": "B"}] * 3, "sft", "data=preference"),
    ([{"text": "a document"}] * 3, "sft", "data=jsonl"),
    ([{"txt": "a document"}] * 3, "pretrain", None)], ids=["sft-as-pairs", "pairs-as-sft", "text-as-sft", "unknown"])
def test_a_file_of_only_malformed_records_names_the_data_group_its_fields_belong_to(tok, write_jsonl, rows, fmt,
                                                                                     group):
    path = write_jsonl("all_bad.jsonl", rows)
    with pytest.raises(DataValidationError) as e:
        build_packed_dataset(DataConfig(format=fmt, path=path, max_bad_fraction=1.0), tok, 64)
    msg = str(e.value)
    assert "3 of 3 records (100.00%) are malformed" in msg and "No record is valid." in msg
    assert (f"are those of {group}." in msg) if group else ("are those of" not in msg), msg


def test_malformed_records_below_threshold_are_reported_and_skipped(tok, write_jsonl, caplog):
    path = write_jsonl("bad.jsonl", BAD_ROWS)
    with caplog.at_level(logging.WARNING, logger="msa_train.data"):
        ds = build_packed_dataset(DataConfig(format="pretrain", path=path, max_bad_fraction=0.7), tok, 64)
    assert _texts(ds, tok) == ["good 1", "good 2", "good 3"]
    assert ds.report.num_bad == 5 and ds.report.total == 8
    assert [x.split(": ", 1)[0] for x in ds.report.examples] == [f"{path}:{n}" for n in (2, 3, 4, 5, 6)]
    assert "5 of 8 records" in caplog.text and f"{path}:2: invalid JSON" in caplog.text


def test_default_threshold_fails_on_one_bad_record(tok, write_jsonl):
    path = write_jsonl("a.jsonl", [{"text": "fine"}] * 99 + ['{"text": null}'])
    with pytest.raises(DataValidationError, match=r"a.jsonl:100: field 'text' must be a string, got null"):
        build_packed_dataset(DataConfig(format="pretrain", path=path), tok, 64)


def test_parquet_null_values_are_reported_with_row(tmp_path, tok):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": "ok"}, {"text": None}]), path)
    with pytest.raises(DataValidationError, match=r"a.parquet:row 1: field 'text' must be a string, got null"):
        load_records(DataConfig(format="pretrain", path=str(path)))


@pytest.mark.parametrize("path_kind, match", [
    ("missing", "does not exist"),
    ("unknown-ext", "set data.file_type"),
    ("empty-dir", "holds no"),
    ("txt-for-sft", "needs structured records"),
])
def test_path_errors(path_kind, match, tmp_path, tok):
    fmt = "sft" if path_kind == "txt-for-sft" else "pretrain"
    path = {"missing": tmp_path / "nope.jsonl", "unknown-ext": tmp_path / "a.csv", "empty-dir": tmp_path / "d",
            "txt-for-sft": tmp_path / "a.txt"}[path_kind]
    if path_kind == "empty-dir":
        path.mkdir()
    elif path_kind != "missing":
        path.write_text("x")
    with pytest.raises(ValueError, match=match):
        build_packed_dataset(DataConfig(format=fmt, path=str(path)), tok, 64)


def test_empty_file_is_an_error(tok, write_jsonl):
    with pytest.raises(DataValidationError, match="no records"):
        build_packed_dataset(DataConfig(format="pretrain", path=write_jsonl("e.jsonl", [])), tok, 64)


def test_num_proc_2_matches_num_proc_1(tok, write_jsonl):
    path = write_jsonl("a.jsonl", [{"text": f"document number {i} " * (i + 1)} for i in range(40)])
    a = build_packed_dataset(DataConfig(format="pretrain", path=path), tok, 128)
    b = build_packed_dataset(DataConfig(format="pretrain", path=path, num_proc=2), tok, 128)
    assert len(a) == len(b) and all(torch.equal(a[i]["input_ids"], b[i]["input_ids"]) for i in range(len(a)))


def test_spark_style_directory_and_wide_parquet(tmp_path, tok, monkeypatch):
    """A Spark output directory with data.file_type set: its _SUCCESS marker is not read; a wide
    table's other columns are never read (only the configured field)."""
    d = tmp_path / "out"
    d.mkdir()
    (d / "_SUCCESS").write_text("")
    rows = [{"text": t, "blob": "x" * 100, "n": i} for i, t in enumerate(DOCS)]
    pq.write_table(pa.Table.from_pylist(rows), d / "part-00000")  # no extension, as Spark may write
    read = []
    real = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        read.append(kwargs.get("columns"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    ds = build_packed_dataset(DataConfig(format="pretrain", path=str(d), file_type="parquet"), tok, 256)
    assert _texts(ds, tok) == sorted(DOCS) and ds.report.num_bad == 0
    assert read == [["text"]]


def test_sft_parquet_mixing_chat_and_prompt_response_rows(tmp_path, tok):
    path = tmp_path / "mix.parquet"
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    pq.write_table(pa.Table.from_pylist([{"messages": chat, "prompt": None, "response": None},
                                         {"messages": None, "prompt": "Q ", "response": "A"}]), path)
    records, report = load_records(DataConfig(format="sft", path=str(path)))
    assert report.num_bad == 0 and len(records) == 2
    assert records[1]["response"] == "A" and records[1]["messages"] == [] and len(records[0]["messages"]) == 2


def test_empty_txt_document_is_no_record(tmp_path, tok):
    (tmp_path / "a.txt").write_text("one document\n")
    (tmp_path / "b.txt").write_text("  \n")
    ds = build_packed_dataset(DataConfig(format="pretrain", path=str(tmp_path)), tok, 64)
    assert _texts(ds, tok) == ["one document\n"] and ds.report.num_bad == 0


def test_a_lone_surrogate_is_a_bad_record_with_its_line(write_jsonl, tok):
    from msa_train.data import DataConfig, DataValidationError, build_packed_dataset

    path = write_jsonl("docs.jsonl", ['{"text": "\\ud800 x"}', {"text": "a good document"}])
    with pytest.raises(DataValidationError, match=rf"{path}:1: field 'text' is not valid Unicode: a lone surrogate"):
        build_packed_dataset(DataConfig(format="pretrain", path=path), tok, 64)
    ds = build_packed_dataset(DataConfig(format="pretrain", path=path, max_bad_fraction=0.5), tok, 64)
    assert ds.report.num_bad == 1 and ds.report.total == 2


def test_a_parquet_file_without_the_text_column_names_its_columns(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from msa_train.data import DataConfig, DataValidationError, build_packed_dataset

    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"body": ["one document", "another"], "id": [1, 2]}), path)
    with pytest.raises(DataValidationError, match=r"no column named as data.text_field='text' / data.segments_field="
                                                  r"'segments'; the file's columns are: body, id \(set "
                                                  r"data.text_field / data.segments_field to one of them\)"):
        build_packed_dataset(DataConfig(format="pretrain", path=str(path)), tok, 64)
    assert len(build_packed_dataset(DataConfig(format="pretrain", path=str(path), text_field="body"), tok, 64)) == 1


def test_an_empty_file_is_named(write_jsonl, tok):
    from msa_train.data import DataConfig, DataValidationError, build_packed_dataset

    path = write_jsonl("empty.jsonl", [""])
    with pytest.raises(DataValidationError, match=rf"data: {path} holds no records"):
        build_packed_dataset(DataConfig(format="pretrain", path=path), tok, 64)
