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

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def _chunk_loss_sum(lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = lm_head(hidden).float()  # [C, V] fp32 for a stable log-softmax
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_linear_cross_entropy_sum(lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                                     chunk_tokens: int = 4096) -> torch.Tensor:
    """Summed next-token CE of ``lm_head(hidden)`` against ``labels``.

    Args:
        lm_head: the model's output projection (hidden -> vocab).
        hidden: [B, T, hidden] final hidden states.
        labels: [B, T] int64 targets already aligned with ``hidden`` (shifted), -100 = no loss.
        chunk_tokens: tokens per chunk; bounds the logits memory to chunk_tokens x vocab.

    Returns:
        Scalar fp32 sum of the per-token losses over tokens whose label is not -100.
    """
    h = hidden.reshape(-1, hidden.shape[-1])  # [B*T, hidden]
    y = labels.reshape(-1)
    total = h.new_zeros((), dtype=torch.float32)
    for start in range(0, h.shape[0], chunk_tokens):
        h_c, y_c = h[start:start + chunk_tokens], y[start:start + chunk_tokens]
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_loss_sum, lm_head, h_c, y_c, use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(lm_head, h_c, y_c)
    return total
