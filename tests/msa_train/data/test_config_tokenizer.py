import pytest

from msa_train.data import TINY_VOCAB_SIZE, DataConfig, build_tokenizer


@pytest.mark.parametrize("kwargs, match", [
    pytest.param({"format": "raw"}, r"data.format='raw' is not one of \['generated', 'pretrain', 'sft', 'preference', 'kto', 'prompts', 'retrieval'\]",
                 id="bad-format"),
    pytest.param({"format": "generated", "path": "x.jsonl"}, "data.path must be empty", id="generated-with-path"),
    pytest.param({"format": "pretrain", "path": "x", "file_type": "csv"}, r"data.file_type='csv' is not one of",
                 id="bad-file-type"),
    pytest.param({"max_bad_fraction": 1.5}, "data.max_bad_fraction", id="bad-fraction"),
    pytest.param({"min_doc_tokens": 500, "max_doc_tokens": 100}, "data.min_doc_tokens", id="min-above-max"),
    pytest.param({"num_proc": 0}, "data.num_proc", id="num-proc-0"),
    pytest.param({"text_sample_by": "word"}, "data.text_sample_by", id="bad-sample-by"),
    pytest.param({"format": "pretrain", "path": ["a", 3]}, "data.path entries", id="path-list-non-str"),
])
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataConfig(**kwargs)


def test_a_file_format_requires_its_path_where_data_is_read():
    with pytest.raises(ValueError, match=r"data.path is required with data.format='sft'"):
        DataConfig(format="sft").require_path()
    DataConfig(format="generated").require_path()
    DataConfig(format="sft", path="x.jsonl").require_path()


def test_config_path_str_or_list():
    assert DataConfig(format="pretrain", path="a.jsonl").paths == ["a.jsonl"]
    assert DataConfig(format="pretrain", path=["a.jsonl", "b"]).paths == ["a.jsonl", "b"]


def test_byte_tokenizer_roundtrip(tok):
    text = "key qzxv = 0123.\n\tünïcode ✓"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert len(tok) == TINY_VOCAB_SIZE == 259
    assert {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id} == {256, 257, 258}


def test_build_tokenizer_default_and_local_dir(tmp_path, tok):
    assert len(build_tokenizer(DataConfig())) == TINY_VOCAB_SIZE
    tok.save_pretrained(tmp_path / "tk")
    # A model directory's tokenizer is used when data.tokenizer is unset ...
    loaded = build_tokenizer(DataConfig(), model_path=str(tmp_path / "tk"))
    assert loaded.encode("abc", add_special_tokens=False) == [97, 98, 99]
    assert loaded.eos_token_id == tok.eos_token_id
    # ... and data.tokenizer=byte overrides it.
    assert len(build_tokenizer(DataConfig(tokenizer="byte"), model_path=str(tmp_path / "nope"))) == TINY_VOCAB_SIZE


def test_build_tokenizer_missing_dir_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="data.tokenizer=.* is not a local directory"):
        build_tokenizer(DataConfig(tokenizer=str(tmp_path / "missing")))
