"""``build_packed_datasets``: config -> records -> tokens -> packed training (and evaluation) sequences."""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Tuple, Union

import datasets
import numpy as np
from transformers import PreTrainedTokenizerBase

from .config import PROMPT_FORMATS, DataConfig
from .generated import generate_corpus
from .packing import KtoExampleDataset, PackedDataset, PreferencePairDataset, plan_packing
from .prompts import build_prompt_datasets
from .sft import apply_long_prompt_policy, trained_per_record
from .sources import column, load_records, split_held_out
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
        item (``PreferencePairDataset``). ``.report`` holds the record counts. Documents
        that ``cfg.eval_fraction`` holds out are not in it.

    Raises:
        ValueError: bad paths or seq_len; DataValidationError: too many malformed records.
    """
    return build_packed_datasets(cfg, tokenizer, seq_len)[0]


def build_packed_datasets(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, seq_len: int, train: bool = True,
                          eval_seq_len: Optional[int] = None
                          ) -> Tuple[Optional[Union[PackedDataset, PreferencePairDataset]],
                                     Optional[Union[PackedDataset, PreferencePairDataset]]]:
    """(training data, held-out evaluation data or None), both as ``build_packed_dataset`` describes.

    The evaluation data is ``cfg.eval_path`` read like ``cfg.path``, or the documents that
    ``cfg.eval_fraction`` holds out of it: a seeded choice of whole documents (or pairs), so no
    token of an evaluation document is trained on. The choice depends only on the number of
    records and the seed, and is made before tokenising, so ``train=False`` (evaluation alone)
    tokenises the held-out documents only and returns None for the training data (with
    ``eval_path``, ``cfg.path`` is not read at all). The evaluation data is packed at
    ``eval_seq_len`` tokens (default: ``seq_len``).
    """
    eval_seq_len = seq_len if eval_seq_len is None else eval_seq_len
    for name, n in (("seq_len", seq_len), ("eval_seq_len", eval_seq_len)):
        if not isinstance(n, int) or n < 2:
            raise ValueError(f"{name}={n!r} must be an int >= 2")
    if cfg.format in PROMPT_FORMATS:  # GRPO's prompts: not packed
        return build_prompt_datasets(cfg, tokenizer, seq_len, train)
    records, report, eval_records = None, None, None
    if train or cfg.eval_fraction > 0:
        records, report = _records(cfg)
    if cfg.eval_fraction > 0:
        records, eval_records = split_held_out(records, cfg)
    elif cfg.eval_path:
        eval_records, _ = _records(dataclasses.replace(cfg, path=cfg.eval_path, eval_path=None))
    train_ds = None
    if train:
        train_ds = _pack(_tokenize(records, cfg, tokenizer), cfg, tokenizer, seq_len, "training")
        train_ds.report = report
    eval_ds = None if eval_records is None else \
        _pack(_tokenize(eval_records, cfg, tokenizer), cfg, tokenizer, eval_seq_len, "evaluation")
    return train_ds, eval_ds


def _records(cfg: DataConfig):
    """The records of ``cfg.path`` (or the generated corpus): (records, RecordReport or None)."""
    if cfg.format == "generated":
        return datasets.Dataset.from_dict({"text": generate_corpus(cfg)}), None
    return load_records(cfg)


def _tokenize(records: datasets.Dataset, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> datasets.Dataset:
    return tokenize_dataset(records, cfg.format, tokenizer, add_bos=cfg.add_bos, num_proc=cfg.num_proc)


def _pack(tokens: datasets.Dataset, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, seq_len: int, what: str):
    pad_id = pad_token_id(tokenizer)
    if len(tokens) == 0:
        raise ValueError(f"data: no {what} records (check data.path / data.eval_path)")
    if cfg.format == "preference":
        bos_id = tokenizer.bos_token_id if cfg.add_bos else None
        ds = PreferencePairDataset(tokens, seq_len, pad_id, bos_id)
        if ds.num_truncated:
            logger.warning("data: %d of %d %s preference pairs are longer than seq_len=%d: %d keep their whole "
                           "responses and the end of their prompt, %d have responses that alone do not fit and are "
                           "cut from the right too; raise seq_len to keep them whole", ds.num_truncated, len(ds), what,
                           seq_len, ds.num_truncated - ds.num_response_cut, ds.num_response_cut)
        return ds
    if cfg.format == "kto":
        ds = KtoExampleDataset(tokens, seq_len, pad_id, tokenizer.bos_token_id if cfg.add_bos else None)
        desirable = int(np.sum(column(tokens, "desirable", numpy=True)))
        logger.info("data (%s): %d KTO examples, %d desirable and %d undesirable", what, len(ds), desirable,
                    len(ds) - desirable)
        if ds.num_truncated:
            logger.warning("data: %d of %d %s KTO examples are longer than seq_len=%d: they keep their completion "
                           "and the end of their prompt", ds.num_truncated, len(ds), what, seq_len)
        return ds
    if cfg.format == "sft":
        tokens = apply_long_prompt_policy(tokens, cfg.long_prompt, seq_len,
                                          tokenizer.bos_token_id if cfg.add_bos else None, what)
        trained = trained_per_record(tokens)
        if not trained.any():  # every step would train nothing
            raise ValueError(f"data: the {len(tokens)} {what} SFT records leave no token to train on at "
                             f"train.seq_len={seq_len}: every label is masked (prompt or chat turns other than "
                             "the assistant's); check data.prompt_field / data.response_field / data.messages_field "
                             "and the tokenizer's chat template")
        if not trained.all():
            logger.warning("data: %d of %d %s SFT records have no token to train on (every label masked): they are "
                           "packed but add no loss", int((trained == 0).sum()), len(trained), what)
    lengths = column(tokens, "length", numpy=True)
    ds = PackedDataset(tokens, plan_packing(lengths, seq_len, cfg.seed), seq_len, pad_id)
    logger.info("data (%s): %d documents, %d tokens -> %d sequences of %d tokens (%.1f%% padding)",
                what, len(tokens), ds.num_tokens, len(ds), seq_len, 100 * ds.padding_fraction)
    return ds
