"""SFT records longer than a packed sequence (``data.long_prompt``), and the check that a run's
data leaves tokens to learn from.

An SFT record is ``prompt`` (the tokens before its first trained label, masked) + ``response``
(from there on: trained, with any later masked turns of a chat). Split into pieces of T tokens
like a pretraining document, a long-prompt record would train response pieces that never see
their prompt, and pieces of prompt alone that train nothing. So a record longer than T is, by
``data.long_prompt``:

- ``truncate_left`` (default): its prompt loses tokens from the beginning (a leading BOS stays)
  until the record fits with its whole response; a response that alone does not fit keeps no
  prompt and is cut from the right (as preference pairs are: ``packing.fit_pair``);
- ``drop``: left out of the data;
- ``error``: the run stops, naming the count and the longest record.

Either way every SFT record is placed whole into one packed sequence.
"""
from __future__ import annotations

import logging

import datasets
import numpy as np
import pyarrow.compute as pc

from .config import LONG_PROMPT
from .sources import column
from .tokenization import IGNORE_INDEX, TOKEN_FEATURES

logger = logging.getLogger(__name__)


def fit_sft_record(ids: np.ndarray, labels: np.ndarray, seq_len: int, bos_id=None) -> tuple:
    """One SFT record cut to at most ``seq_len`` tokens by ``truncate_left`` (module docstring).

    Args:
        ids, labels: int [L] of one tokenised record (labels -100 where masked).
        seq_len: T.
        bos_id: the BOS token that tokenisation put first (None without one): it stays first.

    Returns:
        (ids, labels, the prompt lost tokens, the response lost tokens).
    """
    n = len(ids)
    if n <= seq_len:
        return ids, labels, False, False
    trained = np.flatnonzero(labels != IGNORE_INDEX)
    lp = int(trained[0]) if len(trained) else n  # prompt length
    head = 1 if bos_id is not None and lp and ids[0] == bos_id else 0
    keep_p = min(lp - head, max(0, seq_len - head - (n - lp)))
    keep = np.r_[0:head, lp - keep_p:min(n, lp + seq_len - head - keep_p)]
    return ids[keep], labels[keep], keep_p < lp - head, n - lp > seq_len - head


def apply_long_prompt_policy(tokens: datasets.Dataset, policy: str, seq_len: int, bos_id, what: str
                             ) -> datasets.Dataset:
    """The tokenised SFT records with those longer than ``seq_len`` handled by ``policy``; logs how
    many records each policy would touch.

    Raises:
        ValueError: ``policy="error"`` and a record is too long, or ``drop`` leaves no record.
    """
    if policy not in LONG_PROMPT:
        raise ValueError(f"data.long_prompt={policy!r} is not one of {list(LONG_PROMPT)}")
    lengths = column(tokens, "length", numpy=True)
    long = np.flatnonzero(lengths > seq_len)
    if not len(long):
        return tokens
    n, longest = len(lengths), int(lengths.max())
    rows = tokens.select(long).with_format("numpy", columns=["input_ids", "labels"])
    fitted = [fit_sft_record(r["input_ids"], r["labels"], seq_len, bos_id) for r in rows]
    response_cut = sum(f[3] for f in fitted)
    summary = (f"data: {len(long)} of {n} {what} SFT records are longer than train.seq_len={seq_len} (the longest "
               f"has {longest} tokens). data.long_prompt=truncate_left keeps the response whole and cuts the prompt "
               f"from the left for {len(long) - response_cut} of them; {response_cut} have a response that alone "
               f"does not fit, which keeps no prompt and is cut from the right; data.long_prompt=drop leaves all "
               f"{len(long)} out, data.long_prompt=error stops the run")
    if policy == "error":
        raise ValueError(f"{summary}. Raise train.seq_len, or choose data.long_prompt=truncate_left or drop")
    logger.warning("%s. Policy: %s; raise train.seq_len to keep them whole", summary, policy)
    if policy == "drop":
        if len(long) == n:
            raise ValueError(f"data.long_prompt=drop: every one of the {n} {what} SFT records is longer than "
                             f"train.seq_len={seq_len}; raise train.seq_len or use data.long_prompt=truncate_left")
        return tokens.select(np.setdiff1d(np.arange(n), long))
    # the fitted records replace the long ones, in place (the packing order depends on the index)
    replaced = dict(zip(long.tolist(), fitted))

    def fit(batch, indices):
        for k, i in enumerate(indices):
            if i in replaced:
                ids, lab = replaced[i][:2]
                batch["input_ids"][k], batch["labels"][k], batch["length"][k] = ids.tolist(), lab.tolist(), len(ids)
        return batch

    return tokens.map(fit, batched=True, with_indices=True, features=TOKEN_FEATURES, desc="data.long_prompt")


def trained_per_record(tokens: datasets.Dataset) -> np.ndarray:
    """int64 [N]: the label tokens a packed copy of each whole record trains on: those not -100,
    less the record's first token (a segment start, never trained: packing.py)."""
    labels = tokens.select_columns(["labels"]).with_format("arrow")[:]["labels"]  # honours a select()
    labels = labels.combine_chunks() if labels.num_chunks else labels
    lengths = pc.list_value_length(labels).to_numpy(zero_copy_only=False)
    trained = pc.not_equal(pc.list_flatten(labels), IGNORE_INDEX).to_numpy(zero_copy_only=False)
    starts = np.cumsum(lengths) - lengths
    trained[starts[lengths > 0]] = False
    return np.add.reduceat(trained.astype(np.int64), starts) if len(trained) else np.zeros(len(lengths), np.int64)
