"""Tokenizers: a local HF tokenizer directory, or the built-in byte-level one.

The built-in tokenizer is built in code with the ``tokenizers`` library, so the tiny
recipe and the tests need no download. Every byte is one token (ids 0..255), followed
by three special tokens; ``TINY_VOCAB_SIZE`` is what a tiny model's ``vocab_size`` must be.
"""
from __future__ import annotations

import os
from typing import Optional

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from .config import DataConfig

BYTE_TOKENIZER_NAME = "byte"
TINY_SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
TINY_VOCAB_SIZE = 256 + len(TINY_SPECIAL_TOKENS)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """The built-in byte-level tokenizer: 256 byte tokens plus <|bos|>, <|eos|>, <|pad|> (259 ids)."""
    # ByteLevel maps each byte to one printable character; a BPE with that alphabet
    # as vocabulary and no merges then emits exactly one token per byte, id == byte value.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: _BYTE_OF_CHAR[ch])
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(TINY_SPECIAL_TOKENS))
    bos, eos, pad = TINY_SPECIAL_TOKENS
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad)
    wrapped.model_max_length = 1 << 30  # documents are long by design; packing splits them, not the tokenizer
    assert len(wrapped) == TINY_VOCAB_SIZE, len(wrapped)
    return wrapped


def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte -> printable unicode character table, which ByteLevel uses."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_OF_CHAR = {ch: b for b, ch in _byte_to_char().items()}


def build_tokenizer(cfg: DataConfig, model_path: Optional[str] = None) -> PreTrainedTokenizerBase:
    """The tokenizer the data pipeline and the model share.

    Args:
        cfg: the data config. ``cfg.tokenizer`` wins when set: "byte" for the built-in
            tokenizer, otherwise a local directory.
        model_path: the model's local checkpoint directory (``model.path``); its
            tokenizer is used when ``cfg.tokenizer`` is None.

    Returns:
        A fast tokenizer with ``eos_token_id`` set. Nothing is downloaded.
    """
    source = cfg.tokenizer if cfg.tokenizer is not None else model_path
    if source is None or source == BYTE_TOKENIZER_NAME:
        return byte_tokenizer()
    field = "data.tokenizer" if cfg.tokenizer is not None else "model.path"
    if not os.path.isdir(source):
        raise ValueError(f"{field}={source!r} is not a local directory; tokenizers are loaded from local "
                         f"files only (use data.tokenizer={BYTE_TOKENIZER_NAME} for the built-in one)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"{field}={source!r}: no loadable tokenizer in this directory ({e})") from e
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{field}={source!r}: the tokenizer has no eos token, which packing needs "
                         "to end documents; set eos_token in its tokenizer_config.json")
    return tokenizer


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id padding uses: the pad token, or eos for tokenizers without one (Llama 3). Labels mask it anyway."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
