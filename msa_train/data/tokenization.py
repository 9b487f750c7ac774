"""Validated records -> token ids and labels, one example per record, via ``datasets.map``.

Label convention (HF): ``labels`` are aligned with ``input_ids`` (not shifted); the
model's loss shifts them, so logits at t are scored against ``labels[t + 1]``.
``-100`` masks a token out of the loss: prompt tokens in SFT, non-assistant chat turns,
pretraining segments marked ``train: false``, BOS. Packing masks more (see ``packing.py``).

Every example ends with EOS (trained: the model must learn where a document ends).
"""
from __future__ import annotations

from typing import Optional

import datasets
from transformers import PreTrainedTokenizerBase


IGNORE_INDEX = -100
_CONTENT_MARK = "\ue000msa-train-content\ue000"  # private-use characters: no template or text has them
_IDS = datasets.Sequence(datasets.Value("int32"))
TOKEN_FEATURES = datasets.Features({"input_ids": _IDS, "labels": _IDS, "length": datasets.Value("int32")})
KTO_FEATURES = datasets.Features({"input_ids": _IDS, "labels": _IDS, "length": datasets.Value("int32"),
                                 "desirable": datasets.Value("bool")})
PREFERENCE_FEATURES = datasets.Features({
    "chosen_input_ids": _IDS, "chosen_labels": _IDS, "rejected_input_ids": _IDS, "rejected_labels": _IDS,
    "length": datasets.Value("int32")})


PIECE_CHARS = 1 << 20  # texts longer than this are tokenized in pieces (see _pieces)


def _encode(tokenizer: PreTrainedTokenizerBase, texts: list[str], markup: bool = False) -> list[list[int]]:
    """Token ids of ``texts``. Special tokens are added by hand below, identically for every tokenizer.

    ``markup`` False (document text, prompts, responses): a special token's string inside the
    text (``<|eot_id|>`` in a scraped page) is encoded as the characters it is, never as the
    control token, which would otherwise put an EOS in the middle of a document and train it.
    True for chat-template renderings, whose special tokens are the template's own markup.

    A text longer than :data:`PIECE_CHARS` is encoded piece by piece and the ids joined: a fast
    tokenizer keeps tokens, offsets and more per token of its input, so the pieces bound that to
    one piece's. Measured on a 20 MB document (6.8M tokens, a byte-level BPE, loading and
    tokenizing on CPU): 3.7 GB peak and 40 s whole, 1.8 GB and 20 s in pieces; what is left is the
    document's ids and labels as Python lists."""
    if not texts:
        return []
    pieces, owner = [], []
    for i, text in enumerate(texts):
        for piece in _pieces(text, PIECE_CHARS):
            pieces.append(piece)
            owner.append(i)
    encoded = tokenizer(pieces, add_special_tokens=False, return_attention_mask=False,
                        split_special_tokens=not markup)["input_ids"]
    if len(pieces) == len(texts):
        return encoded
    out: list[list[int]] = [[] for _ in texts]
    for i, ids in zip(owner, encoded):
        out[i] += ids
    return out


def _pieces(text: str, size: int) -> list[str]:
    """``text`` cut into pieces of at most about ``size`` characters, each cut just before a space
    that follows a non-space character, where byte-level BPE pre-tokenizers (GPT-2's, Llama 3's)
    start a new word anyway, so the joined ids are those of the whole text. A text with no such
    space in a window is cut at ``size`` (its ids may differ at that one cut)."""
    if len(text) <= size:
        return [text]
    out, start = [], 0
    while len(text) - start > size:
        end = start + size
        cut = text.rfind(" ", start + size // 2, end)
        while cut > start and text[cut - 1].isspace():  # a run of spaces stays whole
            cut = text.rfind(" ", start + size // 2, cut)
        if cut <= start:
            cut = end
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


def _bos(tokenizer: PreTrainedTokenizerBase, add_bos: bool) -> list[int]:
    return [tokenizer.bos_token_id] if add_bos and tokenizer.bos_token_id is not None else []


def _tokenize_pretrain(batch: dict, tokenizer: PreTrainedTokenizerBase, add_bos: bool) -> dict:
    """Documents: BOS + text + EOS, all trained but BOS. A record with ``segments`` (sources.py:
    ``[{"text", "train"}]``) is its segments' texts, each encoded on its own (as SFT's prompt and
    response are), trained only where ``train`` is true; its EOS is trained when its last segment is."""
    bos, eos = _bos(tokenizer, add_bos), tokenizer.eos_token_id
    segments = batch.get("segments") or [[] for _ in batch["text"]]
    whole = [i for i, segs in enumerate(segments) if not segs]
    parts = iter(_encode(tokenizer, [x["text"] for segs in segments for x in segs]))
    texts = iter(_encode(tokenizer, [batch["text"][i] for i in whole]))
    out_ids, out_labels = [], []
    for segs in segments:
        ids, labels = list(bos), [IGNORE_INDEX] * len(bos)
        if not segs:
            text = next(texts)
            ids += text + [eos]
            labels += text + [eos]
        else:
            for x in segs:
                part = next(parts)
                ids += part
                labels += part if x["train"] else [IGNORE_INDEX] * len(part)
            ids.append(eos)
            labels.append(eos if segs[-1]["train"] else IGNORE_INDEX)
        out_ids.append(ids)
        out_labels.append(labels)
    return {"input_ids": out_ids, "labels": out_labels, "length": [len(x) for x in out_ids]}


def _tokenize_sft(batch: dict, tokenizer: PreTrainedTokenizerBase, add_bos: bool) -> dict:
    """Prompt/response records: BOS + prompt (masked) + response + EOS (trained). Chat: see chat_segments."""
    bos, eos = _bos(tokenizer, add_bos), tokenizer.eos_token_id
    # Every record becomes a list of (text, trained) segments; all texts of the batch are
    # encoded in one tokenizer call.
    # Segments rendered by a chat template hold the template's special tokens as markup; all
    # other texts are plain text (see _encode), so the two kinds are encoded in two calls.
    segments, markup = [], bool(getattr(tokenizer, "chat_template", None))
    for prompt, response, messages in zip(batch["prompt"], batch["response"], batch["messages"]):
        if messages:
            segments.append([(t, trained, markup) for t, trained in chat_segments(messages, tokenizer)])
        else:
            segments.append([(prompt, False, False), (response, True, False)])
    texts = [seg for segs in segments for seg in segs]
    encoded = {m: iter(_encode(tokenizer, [t for t, _, mk in texts if mk == m], markup=m)) for m in (False, True)}
    out_ids, out_labels = [], []
    for segs in segments:
        ids, labels = list(bos), [IGNORE_INDEX] * len(bos)
        for _, trained, mk in segs:
            seg = next(encoded[mk])
            ids += seg
            labels += seg if trained else [IGNORE_INDEX] * len(seg)
        if not ids or ids[-1] != eos:  # chat templates may already end with EOS
            ids.append(eos)
            labels.append(eos if segs[-1][1] else IGNORE_INDEX)
        out_ids.append(ids)
        out_labels.append(labels)
    return {"input_ids": out_ids, "labels": out_labels, "length": [len(x) for x in out_ids]}


def chat_segments(messages: list[dict], tokenizer: PreTrainedTokenizerBase) -> list[tuple[str, bool]]:
    """A conversation as (text, trained) segments; only assistant turns are trained.

    With a chat template: assistant turn i is ``render(messages[:i+1])`` minus
    ``render(messages[:i], add_generation_prompt=True)``, i.e. its content and end-of-turn
    marker, not the role header. This needs a template whose rendering of a prefix of the
    conversation is a prefix of the rendering of the whole; for one that is not (Qwen3
    drops the think blocks of earlier turns), only the last assistant turn is trained and
    what follows it is dropped.

    Without a template (the byte-level tokenizer): ``"{role}: {content}\\n"`` per message,
    with the content and newline of assistant messages trained.

    A template that renders the tokenizer's BOS itself (Llama 3's ``{{ bos_token }}``) has it
    taken off the first segment: the example's one BOS is the one every format adds (``add_bos``).
    """
    if not getattr(tokenizer, "chat_template", None):
        segs = []
        for m in messages:
            segs.append((f"{m['role']}: ", False))
            segs.append((m["content"] + "\n", m["role"] == "assistant"))
        return segs

    def render(msgs: list[dict], generation_prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt) if msgs else ""

    def header(i: int) -> str:
        # the rendering up to assistant turn i's content: the prompt with the generation prompt;
        # for a conversation that opens with the assistant (transformers renders no empty
        # conversation), the first turn rendered with a marker for its content, cut there
        if i > 0:
            return render(messages[:i], True)
        marked = render([{**messages[0], "content": _CONTENT_MARK}])
        return marked.split(_CONTENT_MARK)[0] if _CONTENT_MARK in marked else ""

    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    segs, done = [], ""
    for i in assistant:
        head, full = header(i), render(messages[: i + 1])
        if not (head.startswith(done) and full.startswith(head)):
            break
        segs += [(head[len(done):], False), (full[len(head):], True)]
        done = full
    else:
        whole = render(messages)
        # messages after the last assistant turn: kept (untrained) only when the whole rendering
        # continues this one; a template that renders the last turn differently once more
        # messages follow (Qwen3's think block) would splice them in at the wrong place
        if whole.startswith(done) and len(whole) > len(done):
            segs.append((whole[len(done):], False))
        return _strip_bos(segs, tokenizer)
    last = assistant[-1]
    head, full = header(last), render(messages[: last + 1])
    if not full.startswith(head):
        raise ValueError("the tokenizer's chat template does not render the assistant turn after its prompt")
    return _strip_bos([(head, False), (full[len(head):], True)], tokenizer)


def _strip_bos(segs: list[tuple[str, bool]], tokenizer: PreTrainedTokenizerBase) -> list[tuple[str, bool]]:
    bos = getattr(tokenizer, "bos_token", None)
    if bos and segs and segs[0][0].startswith(bos):
        segs = [(segs[0][0][len(bos):], segs[0][1]), *segs[1:]]
    return segs


def _tokenize_preference(batch: dict, tokenizer: PreTrainedTokenizerBase, add_bos: bool) -> dict:
    """Prompt (masked) + chosen / rejected (trained) + EOS, as two token sequences per pair."""
    bos, eos = _bos(tokenizer, add_bos), [tokenizer.eos_token_id]
    prompts = _encode(tokenizer, batch["prompt"])
    out: dict = {k: [] for k in PREFERENCE_FEATURES}
    for side in ("chosen", "rejected"):
        for p, r in zip(prompts, _encode(tokenizer, batch[side])):
            out[f"{side}_input_ids"].append(bos + p + r + eos)
            out[f"{side}_labels"].append([IGNORE_INDEX] * (len(bos) + len(p)) + r + eos)
    out["length"] = [len(c) + len(r) for c, r in zip(out["chosen_input_ids"], out["rejected_input_ids"])]
    return out


def _tokenize_kto(batch: dict, tokenizer: PreTrainedTokenizerBase, add_bos: bool) -> dict:
    """Unpaired KTO examples: BOS + prompt (masked) + completion + EOS (trained), and the label."""
    bos, eos = _bos(tokenizer, add_bos), [tokenizer.eos_token_id]
    out: dict = {k: [] for k in KTO_FEATURES}
    for p, c in zip(_encode(tokenizer, batch["prompt"]), _encode(tokenizer, batch["completion"])):
        out["input_ids"].append(bos + p + c + eos)
        out["labels"].append([IGNORE_INDEX] * (len(bos) + len(p)) + c + eos)
        out["length"].append(len(bos) + len(p) + len(c) + 1)
    out["desirable"] = list(batch["label"])
    return out


LABELS_VERSION = 2  # raise when the tokenisation or labels of any format change (2: pretraining segments)


def _versioned(batch: dict, fn, tokenizer: PreTrainedTokenizerBase, add_bos: bool, version: int) -> dict:
    """``fn(batch, ...)``; ``version`` is there for the cache's fingerprint (tokenize_dataset)."""
    return fn(batch, tokenizer, add_bos)


def tokenize_dataset(ds: datasets.Dataset, fmt: str, tokenizer: PreTrainedTokenizerBase, add_bos: bool = True,
                     num_proc: int = 1, desc: Optional[str] = None) -> datasets.Dataset:
    """Validated records -> ``input_ids`` / ``labels`` / ``length`` (preference: per side).

    File-backed datasets (``cache_dir`` set) have the result cached next to them by
    ``datasets`` under a fingerprint of the records, the tokenizer and the map's arguments, which
    include :data:`LABELS_VERSION`: ``datasets`` hashes a function by its name, not its code, so a
    release that changes what these functions produce raises the version, and no cache of the old
    labels is reused.
    """
    fn = {"generated": _tokenize_pretrain, "pretrain": _tokenize_pretrain, "sft": _tokenize_sft,
          "preference": _tokenize_preference, "kto": _tokenize_kto}[fmt]
    features = {"preference": PREFERENCE_FEATURES, "kto": KTO_FEATURES}.get(fmt, TOKEN_FEATURES)
    return ds.map(_versioned, batched=True, batch_size=256,
                  fn_kwargs={"fn": fn, "tokenizer": tokenizer, "add_bos": add_bos, "version": LABELS_VERSION},
                  remove_columns=ds.column_names, features=features,
                  num_proc=num_proc if num_proc > 1 else None, desc=desc or "tokenizing")
