"""SFT masking (prompt/response, chat) and preference pairs."""
import pytest
import torch

from msa_train.data import IGNORE_INDEX, DataConfig, DataValidationError, build_packed_dataset

# A minimal prefix-stable template, enough to exercise the chat-template path with the byte tokenizer.
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def _segments(item):
    cu = item["cu_seqlens"].tolist()
    return [(item["input_ids"][s:e], item["labels"][s:e]) for s, e in zip(cu[:-1], cu[1:])]


def _trained_text(tok, labels):
    """The trained tokens, decoded; masked runs become '|'."""
    out, prev = [], False
    for x in labels.tolist():
        if x != IGNORE_INDEX:
            out.append(tok.decode([x]))
        elif prev:
            out.append("|")
        prev = x != IGNORE_INDEX
    return "".join(out).strip("|")


def _one_doc(ds, tok):
    item = ds[0]
    segs = [s for s in _segments(item) if s[0][0] == tok.bos_token_id]
    assert len(segs) == 1
    return segs[0]


def test_prompt_tokens_masked_response_trained(tok, write_jsonl):
    path = write_jsonl("sft.jsonl", [{"prompt": "Question? ", "response": "Answer."}])
    ids, labels = _one_doc(build_packed_dataset(DataConfig(format="sft", path=path), tok, 64), tok)
    n_prompt = 1 + len("Question? ")  # BOS + prompt
    assert (labels[:n_prompt] == IGNORE_INDEX).all()
    assert labels[n_prompt:].tolist() == ids[n_prompt:].tolist()
    assert tok.decode(ids[n_prompt:]) == "Answer." + tok.eos_token  # the response ends with a trained EOS


def test_custom_sft_fields(tok, write_jsonl):
    path = write_jsonl("sft.jsonl", [{"q": "Q", "a": "A"}])
    ds = build_packed_dataset(DataConfig(format="sft", path=path, prompt_field="q", response_field="a"), tok, 16)
    ids, labels = _one_doc(ds, tok)
    assert _trained_text(tok, labels) == "A" + tok.eos_token


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Ciao"}]


def test_chat_only_assistant_turns_trained_builtin_format(tok, write_jsonl):
    path = write_jsonl("chat.jsonl", [{"messages": CHAT}])
    ids, labels = _one_doc(build_packed_dataset(DataConfig(format="sft", path=path), tok, 128), tok)
    assert tok.decode(ids[1:]) == ("system: Be brief.\nuser: Hi\nassistant: Hello\nuser: Bye\nassistant: Ciao\n"
                                   + tok.eos_token)
    assert _trained_text(tok, labels) == "Hello\n|Ciao\n" + tok.eos_token


def test_chat_only_assistant_turns_trained_with_template(tok, write_jsonl):
    chat_tok = tok.__class__(tokenizer_object=tok.backend_tokenizer, bos_token=tok.bos_token,
                             eos_token=tok.eos_token, pad_token=tok.pad_token)
    chat_tok.chat_template = TEMPLATE
    path = write_jsonl("chat.jsonl", [{"messages": CHAT}])
    ids, labels = _one_doc(build_packed_dataset(DataConfig(format="sft", path=path), chat_tok, 128), chat_tok)
    assert tok.decode(ids[1:]).startswith("<system>Be brief.</s><user>Hi</s><assistant>Hello</s>")
    # Role headers are masked; content and end-of-turn marker of assistant turns are trained.
    assert _trained_text(tok, labels) == "Hello</s>|Ciao</s>" + tok.eos_token


def _chat_tok(tok, template):
    t = tok.__class__(tokenizer_object=tok.backend_tokenizer, bos_token=tok.bos_token, eos_token=tok.eos_token,
                      pad_token=tok.pad_token)
    t.chat_template = template
    return t


# Llama 3 Instruct's template in miniature: it renders the BOS itself before the first message
BOS_TEMPLATE = ("{% for m in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
                "<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
# Qwen3's shape: the last assistant turn renders differently once another message follows it
LAST_TURN_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{% if m['role'] == 'assistant' and loop.last %}"
                      "<think></think>{% endif %}{{ m['content'] }}</s>{% endfor %}"
                      "{% if add_generation_prompt %}<assistant>{% endif %}")


def _chat_doc(tok, write_jsonl, template, messages):
    """(ids, labels) of one chat record tokenised with ``template``."""
    chat_tok = _chat_tok(tok, template)
    path = write_jsonl("chat.jsonl", [{"messages": messages}])
    return _one_doc(build_packed_dataset(DataConfig(format="sft", path=path), chat_tok, 128), chat_tok)


def test_template_that_renders_bos_gives_one_bos(tok, write_jsonl):
    ids, labels = _chat_doc(tok, write_jsonl, BOS_TEMPLATE, CHAT)
    assert ids.tolist().count(tok.bos_token_id) == 1
    assert tok.decode(ids[1:]).startswith("<system>Be brief.</s><user>Hi</s><assistant>Hello</s>")
    assert _trained_text(tok, labels) == "Hello</s>|Ciao</s>" + tok.eos_token


def test_turns_after_the_last_assistant_turn_are_not_spliced_in(tok, write_jsonl):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Thanks"}]
    ids, labels = _chat_doc(tok, write_jsonl, LAST_TURN_TEMPLATE, msgs)
    # the trailing user turn does not continue this rendering: dropped, not cut in the middle
    assert tok.decode(ids[1:]) == "<user>Hi</s><assistant><think></think>Hello</s>" + tok.eos_token
    assert _trained_text(tok, labels) == "<think></think>Hello</s>" + tok.eos_token


def test_conversation_opening_with_the_assistant_masks_its_header(tok, write_jsonl):
    msgs = [{"role": "assistant", "content": "How can I help?"}, {"role": "user", "content": "x"},
            {"role": "assistant", "content": "y"}]
    ids, labels = _chat_doc(tok, write_jsonl, TEMPLATE, msgs)
    assert tok.decode(ids[1:]).startswith("<assistant>How can I help?</s><user>x</s><assistant>y</s>")
    assert _trained_text(tok, labels) == "How can I help?</s>|y</s>" + tok.eos_token


@pytest.mark.parametrize("fmt, record", [
    ("pretrain", {"text": "a<|eos|>b<|pad|>"}),
    ("sft", {"prompt": "p<|eos|>", "response": "r<|bos|>"}),
], ids=["pretrain", "sft"])
def test_special_token_strings_in_text_stay_text(fmt, record, tok, write_jsonl):
    path = write_jsonl("d.jsonl", [record])
    ids, _ = _one_doc(build_packed_dataset(DataConfig(format=fmt, path=path), tok, 64), tok)
    ids = ids.tolist()
    # one BOS in front and one EOS at the end, both added; the strings in the text are bytes
    assert ids.count(tok.bos_token_id) == 1 and ids.count(tok.eos_token_id) == 1 and ids[-1] == tok.eos_token_id
    assert tok.pad_token_id not in ids
    assert tok.decode(ids[1:-1]) == "".join(v for k, v in record.items())


@pytest.mark.parametrize("messages, reason", [
    ("not a list", "field 'messages' must be a non-empty list"),
    ([], "field 'messages' must be a non-empty list"),
    (["hi"], "messages[0] must be an object"),
    ([{"role": "bot", "content": "x"}], "messages[0].role must be one of"),
    ([{"role": "user", "content": 3}], "messages[0].content must be a string, got int"),
    ([{"role": "user", "content": "only a question"}], "field 'messages' has no non-empty assistant message"),
], ids=["string", "empty", "item-not-object", "bad-role", "content-int", "no-assistant"])
def test_malformed_chat_records(messages, reason, tok, write_jsonl):
    path = write_jsonl("chat.jsonl", [{"messages": CHAT}, {"messages": messages}])
    with pytest.raises(DataValidationError) as e:
        build_packed_dataset(DataConfig(format="sft", path=path), tok, 128)
    assert f"chat.jsonl:2: {reason}" in str(e.value)


def test_sft_missing_fields_reason(tok, write_jsonl):
    path = write_jsonl("sft.jsonl", [{"question": "q"}, {"prompt": "p"}])
    with pytest.raises(DataValidationError) as e:
        build_packed_dataset(DataConfig(format="sft", path=path), tok, 64)
    assert "sft.jsonl:1: missing fields: either 'messages' (chat) or 'prompt' and 'response'" in str(e.value)
    assert "sft.jsonl:2: missing field 'response'" in str(e.value)


def test_preference_pairs(tok, write_jsonl):
    rows = [{"prompt": "P:", "chosen": "good", "rejected": "bad"},
            {"prompt": "Q:", "chosen": "x" * 50, "rejected": "y" * 50}]
    ds = build_packed_dataset(DataConfig(format="preference", path=write_jsonl("p.jsonl", rows)), tok, 64)
    assert len(ds) == 2 and ds.num_truncated == 1
    (c_ids, c_lab), (r_ids, r_lab), *pad = _segments(ds[0])
    assert tok.decode(c_ids) == tok.bos_token + "P:good" + tok.eos_token
    assert tok.decode(r_ids) == tok.bos_token + "P:bad" + tok.eos_token
    assert _trained_text(tok, c_lab) == "good" + tok.eos_token and _trained_text(tok, r_lab) == "bad" + tok.eos_token
    long = ds[1]
    assert long["cu_seqlens"].tolist() == [0, 32, 64]  # cut to T // 2 per side
    assert (long["position_ids"][32:] == torch.arange(32)).all()


def test_preference_pair_with_a_long_prompt_keeps_its_responses(tok, write_jsonl):
    """A pair over T keeps both whole responses and its prompt's end (after BOS): cut from the right,
    a prompt of half the sequence would leave a side with no response token to learn from."""
    prompt = "".join(chr(ord("a") + i % 26) for i in range(100))
    rows = [{"prompt": prompt, "chosen": "good", "rejected": "bad"}]
    ds = build_packed_dataset(DataConfig(format="preference", path=write_jsonl("p.jsonl", rows)), tok, 64)
    assert (ds.num_truncated, ds.num_prompt_cut, ds.num_response_cut) == (1, 1, 0)
    (c_ids, c_lab), (r_ids, r_lab), *pad = _segments(ds[0])
    keep = (64 - 5 - 4) // 2 - 1  # both responses + EOS whole, the rest shared by the prompt halves
    assert tok.decode(c_ids) == tok.bos_token + prompt[-keep:] + "good" + tok.eos_token
    assert tok.decode(r_ids) == tok.bos_token + prompt[-keep:] + "bad" + tok.eos_token
    assert _trained_text(tok, c_lab) == "good" + tok.eos_token and _trained_text(tok, r_lab) == "bad" + tok.eos_token
    assert ds[0]["cu_seqlens"].tolist() == [0, 1 + keep + 5, 2 + 2 * keep + 9, 64]


def test_fit_pair_cuts_responses_only_when_they_alone_do_not_fit():
    import numpy as np

    from msa_train.data.packing import fit_pair

    def side(n_prompt, n_resp):
        ids = np.arange(1, 1 + n_prompt + n_resp)
        return ids, np.concatenate([np.full(n_prompt, -100), ids[n_prompt:]])

    fits = fit_pair(*side(3, 10), *side(3, 10), 26)
    assert fits[1:] == (False, False) and len(fits[0][0][0]) == 13
    (c, _), (r, _) = fit_pair(*side(3, 30), *side(3, 10), 32, bos_id=None)[0]
    assert len(c) == 22 and len(r) == 10 and c[0] == 4 and r[0] == 4  # no prompt left, chosen cut to the room left
    sides, prompt_cut, response_cut = fit_pair(*side(20, 6), *side(20, 4), 30, bos_id=1)
    (c, cl), (r, rl) = sides
    assert prompt_cut and not response_cut and c[0] == r[0] == 1  # BOS kept first
    assert (cl != -100).sum() == 6 and (rl != -100).sum() == 4 and len(c) + len(r) <= 30
