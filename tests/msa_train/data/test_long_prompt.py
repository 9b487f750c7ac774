"""SFT records longer than train.seq_len (data.long_prompt) and data that trains nothing."""
import logging

import pytest
import torch

from msa_train.data import IGNORE_INDEX, DataConfig, build_packed_dataset

T = 96
PROMPT = "".join(f"line {i} of a long prompt\n" for i in range(20))  # 20 * 23 = 460 tokens > T


def _records(n=3, response="the answer."):
    return [{"prompt": f"[{i}] " + PROMPT, "response": response} for i in range(n)]


def _docs(ds):
    """The (ids, labels) segments of every packed item that hold a document (not the padding)."""
    out = []
    for i in range(len(ds)):
        item = ds[i]
        cu = item["cu_seqlens"].tolist()
        for s, e in zip(cu[:-1], cu[1:]):
            if s < item["num_tokens"]:
                out.append((item["input_ids"][s:e], item["labels"][s:e]))
    return out


def test_truncate_left_keeps_the_whole_response_and_the_end_of_the_prompt(tok, write_jsonl, caplog):
    path = write_jsonl("sft.jsonl", _records())
    with caplog.at_level(logging.WARNING, logger="msa_train"):
        ds = build_packed_dataset(DataConfig(format="sft", path=path), tok, T)
    assert "3 of 3 training SFT records are longer than train.seq_len=96" in caplog.text
    assert "cuts the prompt from the left for 3 of them; 0 have a response" in caplog.text
    assert "drop leaves all 3 out" in caplog.text
    docs = _docs(ds)
    assert len(docs) == 3  # one segment per record: none split into pieces
    for ids, labels in docs:
        assert len(ids) == T and ids[0] == tok.bos_token_id
        text = tok.decode(ids[1:])
        assert text.endswith("line 19 of a long prompt\nthe answer." + tok.eos_token)
        trained = labels[labels != IGNORE_INDEX]
        assert tok.decode(trained) == "the answer." + tok.eos_token


def test_a_response_longer_than_seq_len_keeps_no_prompt_and_is_cut_from_the_right(tok, write_jsonl, caplog):
    path = write_jsonl("sft.jsonl", [{"prompt": "Q: ", "response": "x" * 150}])
    with caplog.at_level(logging.WARNING, logger="msa_train"):
        ds = build_packed_dataset(DataConfig(format="sft", path=path), tok, T)
    assert "1 have a response that alone does not fit" in caplog.text
    (ids, labels), = _docs(ds)
    assert ids[0] == tok.bos_token_id and tok.decode(ids[1:]) == "x" * (T - 1)
    assert (labels[1:] != IGNORE_INDEX).all()


def test_drop_leaves_long_records_out_and_error_stops(tok, write_jsonl, caplog):
    path = write_jsonl("sft.jsonl", _records(2) + [{"prompt": "short? ", "response": "yes."}])
    with caplog.at_level(logging.WARNING, logger="msa_train"):
        ds = build_packed_dataset(DataConfig(format="sft", path=path, long_prompt="drop"), tok, T)
    assert "2 of 3 training SFT records" in caplog.text and "Policy: drop" in caplog.text
    (ids, _), = _docs(ds)
    assert tok.decode(ids[1:]) == "short? yes." + tok.eos_token
    with pytest.raises(ValueError, match=r"data\.long_prompt=drop: every one of the 2 training SFT records"):
        build_packed_dataset(DataConfig(format="sft", path=write_jsonl("b.jsonl", _records(2)), long_prompt="drop"),
                             tok, T)
    with pytest.raises(ValueError, match=r"2 of 3 training SFT records are longer.*the longest has 507 tokens.*"
                                         r"Raise train\.seq_len"):
        build_packed_dataset(DataConfig(format="sft", path=path, long_prompt="error"), tok, T)
    with pytest.raises(ValueError, match=r"data\.long_prompt='left' is not one of"):
        DataConfig(format="sft", path=path, long_prompt="left")


def test_every_packed_sequence_of_long_prompt_sft_trains_some_token(tok, write_jsonl):
    """The issue's case in miniature: split into pieces, most sequences held prompt only (loss 0)."""
    path = write_jsonl("sft.jsonl", _records(8))
    ds = build_packed_dataset(DataConfig(format="sft", path=path), tok, T)
    assert all((ds[i]["labels"] != IGNORE_INDEX).any() for i in range(len(ds)))


def test_data_that_leaves_no_supervised_token_is_an_error(tok, write_jsonl, caplog):
    # a template that renders no assistant content: every label is masked
    chat_tok = tok.__class__(tokenizer_object=tok.backend_tokenizer, bos_token=tok.bos_token,
                             eos_token=tok.eos_token, pad_token=tok.pad_token)
    chat_tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' %}<{{ m['role'] }}>"
                              "{{ m['content'] }}{% endif %}{% endfor %}{{ eos_token }}")
    path = write_jsonl("chat.jsonl", [{"messages": [{"role": "user", "content": "Hi"},
                                                    {"role": "assistant", "content": "Hello"}]}] * 2)
    with pytest.raises(ValueError, match=r"the 2 training SFT records leave no token to train on"):
        build_packed_dataset(DataConfig(format="sft", path=path), chat_tok, T)
    # some such records among trained ones: a warning counts them
    mixed = write_jsonl("mixed.jsonl", [{"messages": [{"role": "user", "content": "Hi"},
                                                      {"role": "assistant", "content": "Hello"}]},
                                        {"prompt": "Q? ", "response": "A.", "messages": None}])
    with caplog.at_level(logging.WARNING, logger="msa_train"):
        build_packed_dataset(DataConfig(format="sft", path=mixed), chat_tok, T)
    assert "1 of 2 training SFT records have no token to train on" in caplog.text


def test_records_that_fit_are_unchanged(tok, write_jsonl):
    path = write_jsonl("sft.jsonl", [{"prompt": "Q? ", "response": "A."}])
    (ids, labels), = _docs(build_packed_dataset(DataConfig(format="sft", path=path), tok, T))
    assert torch.equal(ids, torch.tensor([tok.bos_token_id, *tok.encode("Q? A."), tok.eos_token_id]))
