"""Chunked linear cross-entropy: the LM head and the loss without full-vocab logits.

For T = 1M tokens and a 128K vocabulary, logits would take 256 GB in fp16. We split the tokens
into chunks of ``chunk_tokens``, and for each chunk compute ``lm_head(h) -> float32 logits -> CE``
under ``torch.utils.checkpoint``: the forward keeps only the chunk's hidden states, and backward
recomputes that chunk's logits, so at most one chunk of logits (chunk_tokens x V) is alive at a
time in either pass. (liger-kernel's fused linear CE is not a dependency, and neither torch nor
transformers ships one that keeps logits out of memory; this is the plain-PyTorch equivalent.)

The LM head is called as a module (not through its weight) so ZeRO-3's parameter gathering hooks
fire for it, including during the recomputation in backward.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def _chunk_loss_sum(lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                    segments: Optional[torch.Tensor] = None, num_segments: int = 0,
                    with_correct: bool = False) -> torch.Tensor:
    logits = lm_head(hidden).float()  # [C, V] fp32 for a stable log-softmax
    if segments is None:
        return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    losses = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")  # 0 where ignored
    sums = losses.new_zeros(num_segments).index_add(0, segments, losses)
    if not with_correct:
        return sums
    correct = ((logits.argmax(-1) == labels) & (labels != IGNORE_INDEX)).float()
    return torch.stack([sums, losses.new_zeros(num_segments).index_add(0, segments, correct)])


def chunked_linear_cross_entropy_sum(lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                                     chunk_tokens: int = 4096, segments: Optional[torch.Tensor] = None,
                                     num_segments: int = 0, with_correct: bool = False) -> torch.Tensor:
    """Summed next-token CE of ``lm_head(hidden)`` against ``labels``.

    Args:
        lm_head: the model's output projection (hidden -> vocab).
        hidden: [B, T, hidden] final hidden states.
        labels: [B, T] int64 targets already aligned with ``hidden`` (shifted), -100 = no loss.
        chunk_tokens: tokens per chunk; bounds the logits memory to chunk_tokens x vocab.
        segments: optional int64 [B, T] segment id of every token (< ``num_segments``): the sums
            are then taken per segment (DPO's per-sequence log-probabilities).
        with_correct: with ``segments``, also count per segment the tokens whose label is the
            argmax of the logits (evaluation; no gradient flows through the count).

    Returns:
        fp32 sum of the per-token losses over tokens whose label is not -100: a scalar, or
        [num_segments] with ``segments``, or [2, num_segments] (sums, correct counts) with
        ``with_correct``.
    """
    if with_correct and segments is None:
        raise ValueError("chunked_linear_cross_entropy_sum: with_correct=True needs segments")
    h = hidden.reshape(-1, hidden.shape[-1])  # [B*T, hidden]
    y = labels.reshape(-1)
    seg = None if segments is None else segments.reshape(-1)
    shape = () if seg is None else (2, num_segments) if with_correct else (num_segments,)
    total = h.new_zeros(shape, dtype=torch.float32)
    for start in range(0, h.shape[0], chunk_tokens):
        part = (h[start:start + chunk_tokens], y[start:start + chunk_tokens],
                None if seg is None else seg[start:start + chunk_tokens], num_segments, with_correct)
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_loss_sum, lm_head, *part, use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(lm_head, *part)
    return total
