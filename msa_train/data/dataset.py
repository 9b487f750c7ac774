"""``build_packed_dataset``: config -> records -> tokens -> packed sequences."""
from __future__ import annotations

import logging
from typing import Union

import datasets
from transformers import PreTrainedTokenizerBase

from .config import DataConfig
from .generated import generate_corpus
from .packing import PackedDataset, PreferencePairDataset, plan_packing
from .sources import column, load_records
from .tokenization import tokenize_dataset
from .tokenizer import pad_token_id

logger = logging.getLogger(__name__)


def build_packed_dataset(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase,
                         seq_len: int) -> Union[PackedDataset, PreferencePairDataset]:
    """The training data of ``cfg`` as packed sequences of ``seq_len`` tokens.

    Args:
        cfg: the data config (format, files, fields, validation threshold, seed).
        tokenizer: from ``build_tokenizer``.
        seq_len: T, the tokens of one packed sequence.

    Returns:
        A map-style dataset whose items hold ``input_ids``, ``labels``, ``position_ids``
        (int64 [T]), ``cu_seqlens`` (int32 [N+1], last == T) and ``max_seqlen`` (int);
        see ``packing.py`` for the convention. For ``format="preference"``, one pair per
        item (``PreferencePairDataset``). ``.report`` holds the record counts.

    Raises:
        ValueError: bad paths or seq_len; DataValidationError: too many malformed records.
    """
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len={seq_len!r} must be an int >= 2")
    if cfg.format == "generated":
        records, report = datasets.Dataset.from_dict({"text": generate_corpus(cfg)}), None
    else:
        records, report = load_records(cfg)
    tokens = tokenize_dataset(records, cfg.format, tokenizer, add_bos=cfg.add_bos, num_proc=cfg.num_proc)
    pad_id = pad_token_id(tokenizer)

    if cfg.format == "preference":
        ds = PreferencePairDataset(tokens, seq_len, pad_id)
        if ds.num_truncated:
            logger.warning("data: %d of %d preference pairs are longer than seq_len=%d and were cut from the right",
                           ds.num_truncated, len(ds), seq_len)
    else:
        lengths = column(tokens, "length", numpy=True)
        if cfg.format == "sft" and (lengths > seq_len).any():
            logger.warning("data: %d of %d SFT records are longer than seq_len=%d and are split into pieces "
                           "that do not see their prompt; raise seq_len to keep them whole",
                           int((lengths > seq_len).sum()), len(lengths), seq_len)
        ds = PackedDataset(tokens, plan_packing(lengths, seq_len, cfg.seed), seq_len, pad_id)
        logger.info("data: %d documents, %d tokens -> %d sequences of %d tokens (%.1f%% padding)",
                    len(tokens), ds.num_tokens, len(ds), seq_len, 100 * ds.padding_fraction)
    ds.report = report
    return ds
