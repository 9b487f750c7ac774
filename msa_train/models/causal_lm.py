"""The module DeepSpeed wraps: the patched HF model plus the chunked linear cross-entropy."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from msa_train.loss import chunked_linear_cross_entropy_sum


class CausalLMWithLoss(nn.Module):
    """``forward`` returns the summed next-token loss; parameters are those of ``self.lm``.

    The HF LM head is never run on the whole sequence: the decoder's hidden states go to
    :func:`chunked_linear_cross_entropy_sum`, so [T, vocab] logits are never materialised.
    """

    def __init__(self, lm: nn.Module, chunk_tokens: int, loss_impl: str = "fused"):
        super().__init__()
        self.lm = lm
        self.chunk_tokens = chunk_tokens
        self.loss_impl = loss_impl

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, targets: torch.Tensor,
                cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
                segments: Optional[torch.Tensor] = None, num_segments: int = 0,
                with_correct: bool = False) -> torch.Tensor:
        """
        Args:
            input_ids, position_ids: int64 [1, T]; positions restart at every document.
            targets: int64 [1, T], the next token of each position, -100 where no loss counts
                (last token of each document, masked prompt tokens, padding).
            cu_seqlens: int32 [N+1] document offsets on the model's device.
            max_seqlen: longest document (Python int).
            segments, num_segments: optional int64 [1, T] segment of every token: the losses are
                then summed per segment (minus a pair's log-probabilities, for DPO).
            with_correct: with ``segments``, also count each segment's argmax-correct tokens.

        Returns:
            fp32 sum of the token losses: a scalar, or [num_segments] with ``segments``, or
            [2, num_segments] (loss sums, correct counts) with ``with_correct``.
        """
        extra = {}
        if cu_seqlens is not None:
            # HF's FlashAttention kwarg names: they flow through the decoder layers to the attention call.
            extra = dict(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_seqlen,
                         max_length_k=max_seqlen)
        hidden = self.lm.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                               **extra).last_hidden_state  # [1, T, hidden]
        return chunked_linear_cross_entropy_sum(self.lm.lm_head, hidden, targets, self.chunk_tokens, segments,
                                                num_segments, with_correct, impl=self.loss_impl)
