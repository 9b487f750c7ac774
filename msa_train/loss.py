"""Chunked linear cross-entropy: the LM head and the loss without full-vocab logits.

For T = 1M tokens and a 128K vocabulary, logits would take 256 GB in fp16. We split the tokens
into chunks of ``chunk_tokens``; at most one chunk of logits (chunk_tokens x V) is alive at a time.

Two forms:

- ``fused`` (the language-model loss in training): the forward computes, chunk by chunk, the
  loss and its gradients with respect to the hidden states and the head's weight, and keeps only
  those (``dh`` in place of the hidden states a recomputation would keep, plus ``dW``: V x H in
  the model's dtype, 1 GB for Llama-3-8B, held until the backward); the backward scales them by
  the incoming gradient (the product in fp32). A chunk takes three matmuls (logits, dh, dW), not
  four (the logits twice), and the softmax becomes its gradient in place. Under ZeRO-3 the weight is
  gathered once for all chunks (and once more for the backward, by ZeRO-3's hooks), not once per
  chunk in each pass. On CUDA a Triton kernel turns a chunk's logits into their loss and gradient
  in place (why not liger-kernel's: ``_FusedLinearCrossEntropy``).
- ``recompute`` (per-segment sums for DPO, evaluation, heads with a bias, or
  ``train.loss_impl=recompute``): each chunk's ``lm_head -> fp32 logits -> CE`` under
  ``torch.utils.checkpoint``, so the backward recomputes that chunk's logits. The LM head is
  called as a module (not through its weight) so ZeRO-3's parameter gathering hooks fire for it,
  including during the recomputation in backward.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from msa_train.config import LOSS_IMPLS

IGNORE_INDEX = -100


@triton.jit
def _ce_rows_kernel(logits_ptr, stride, labels_ptr, loss_ptr, n_cols, ignore_index,
                    WANT_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    """One row of logits: its CE loss (fp32), and with WANT_GRAD the loss's gradient over the row.

    Two passes over the row in the logits' dtype (two reads, one write), math in fp32: an online max / sum of exps for the
    log-sum-exp, then ``softmax - onehot`` (0 for an ignored label) stored in place of the logits.
    """
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    y = tl.load(labels_ptr + row)
    valid = y != ignore_index
    offs = tl.arange(0, BLOCK)
    m = float("-inf")
    s = 0.0
    for start in range(0, n_cols, BLOCK):
        x = tl.load(base + start + offs, mask=start + offs < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    x_y = tl.load(base + tl.where(valid, y, 0)).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - x_y, 0.0))
    if WANT_GRAD:
        scale = tl.where(valid, 1.0, 0.0)
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            x = tl.load(base + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
            p = tl.exp(x - lse)
            p = tl.where(cols == y, p - 1.0, p) * scale
            tl.store(base + cols, p.to(logits_ptr.dtype.element_ty), mask=cols < n_cols)


@triton.jit
def _scale_kernel(x_ptr, n, g_ptr, BLOCK: tl.constexpr):
    """x *= g in fp32, one rounding to x's dtype; g is read from the device (no host sync)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(g_ptr).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=offs < n).to(tl.float32)
    tl.store(x_ptr + offs, (x * g).to(x_ptr.dtype.element_ty), mask=offs < n)


def _scale_(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``x *= g`` (g a 0-dim device tensor) with the product in fp32 and rounded once, as the
    recomputed form's gradient is scaled before its rounding: a bf16 ``x.mul_(g)`` would round g
    itself to bf16 first, scaling the step's whole gradient by up to 0.4%."""
    if x.dtype == torch.float32:
        return x.mul_(g)
    if x.is_cuda:
        block = 4096
        _scale_kernel[(triton.cdiv(x.numel(), block),)](x, x.numel(), g.float(), BLOCK=block, num_warps=4)
        return x
    for part in x.view(-1).split(1 << 22):  # CPU: fp32 temporaries a slice at a time
        part.copy_(part.float().mul_(g))
    return x


def _ce_rows_triton(logits: torch.Tensor, y: torch.Tensor, want_grad: bool, block: int = 8192):
    """Per-row CE of ``logits`` [C, V] (contiguous rows) against ``y``; with ``want_grad`` the
    gradient is written over ``logits``, which is returned. Two reads and one write of the bf16
    logits where PyTorch's ops take about a dozen passes over fp32 copies (the fp32 cast,
    log-sum-exp, the softmax, its one-hot and mask, the cast back)."""
    if logits.stride(1) != 1:
        raise ValueError(f"_ce_rows_triton: logits must have contiguous rows, got strides {logits.stride()}")
    y = y.contiguous()
    loss = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    block = min(block, triton.next_power_of_2(logits.shape[1]))
    _ce_rows_kernel[(logits.shape[0],)](logits, logits.stride(0), y, loss, logits.shape[1], IGNORE_INDEX,
                                        WANT_GRAD=want_grad, BLOCK=block, num_warps=8)
    return loss, (logits if want_grad else None)


def _ce_rows_torch(logits: torch.Tensor, y: torch.Tensor, want_grad: bool):
    """The same as :func:`_ce_rows_triton` in PyTorch ops (CPU), over an fp32 copy of the logits."""
    x = logits.float()
    valid = y != IGNORE_INDEX
    safe = torch.where(valid, y, 0)[:, None]
    lse = torch.logsumexp(x, dim=-1)
    loss = torch.where(valid, lse - x.gather(1, safe)[:, 0], 0.0)
    if not want_grad:
        return loss, None
    grad = x.sub_(lse[:, None]).exp_()  # softmax, in place
    grad.scatter_add_(1, safe, -valid[:, None].to(grad.dtype))  # minus the one-hot target
    return loss, grad.mul_(valid[:, None]).to(logits.dtype)  # ignored tokens: no gradient


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Summed CE of ``hidden @ weight.T`` against ``labels``, with its gradients taken in the forward.

    ``hidden`` [N, H] and ``weight`` [V, H] in the model's dtype; the logits of a chunk are
    rounded to that dtype by the matmul and taken to fp32 for the softmax, as ``lm_head(h).float()``
    does in the recomputed form. dW is accumulated over the chunks by the matmul's epilogue in the
    weight's dtype (one rounding per chunk, as autograd's sum of the chunks' gradients). On CUDA
    the per-row loss and gradient come from :func:`_ce_rows_triton` (liger-kernel's fused linear
    CE, which does the same, syncs the host twice a call: ``.item()`` in its forward and
    ``torch.equal`` in its backward; a training step here has no host sync). Measured against
    liger-kernel 0.8.5 on an H100 (16K tokens, Llama-3-8B's head, forward + backward, bf16;
    benchmarks/results/fused_ops/liger_h100.md): ours 78.9 ms, liger's 93.6, HF's 105.3.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens):
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        rows = _ce_rows_triton if hidden.is_cuda else _ce_rows_torch
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        dh = torch.empty_like(hidden) if want_h else None
        dw = torch.zeros_like(weight) if want_w else None
        for start in range(0, hidden.shape[0], chunk_tokens):
            h, y = hidden[start:start + chunk_tokens], labels[start:start + chunk_tokens]
            loss, grad = rows(h @ weight.t(), y, want_h or want_w)  # logits [C, V] in the model's dtype
            total += loss.sum()
            if want_h:
                torch.mm(grad, weight, out=dh[start:start + chunk_tokens])
            if want_w:
                dw.addmm_(grad.t(), h)
        ctx.save_for_backward(dh, dw)
        ctx.used = False
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        # Scaled in place: dh is as large as the hidden states (8 GB at 1M tokens for a 4096-wide model).
        if ctx.used:
            raise RuntimeError("backward through the fused linear cross-entropy ran twice (retain_graph); "
                               "use train.loss_impl=recompute")
        ctx.used = True
        dh, dw = ctx.saved_tensors
        return (None if dh is None else _scale_(dh, g), None if dw is None else _scale_(dw, g), None, None)


def _fused_applies(lm_head: nn.Module, hidden: torch.Tensor, segments) -> bool:
    return (segments is None and torch.is_grad_enabled() and isinstance(lm_head, nn.Linear)
            and lm_head.bias is None and (hidden.requires_grad or lm_head.weight.requires_grad))


def _fused_sum(lm_head: nn.Linear, h: torch.Tensor, y: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    if not hasattr(lm_head.weight, "ds_id"):
        return _FusedLinearCrossEntropy.apply(h, lm_head.weight, y, chunk_tokens)
    # ZeRO-3 partitions the weight and gathers it only around the head module's own calls (and its
    # backward), so the fused loss runs as the head's forward for this one call: the hooks gather
    # the weight once for every chunk, and the weight's gradient reaches ZeRO-3 as a Linear's does.
    # dW (V x H) is then held on every rank from the forward to the backward.
    own = lm_head.__dict__.get("forward")  # an instance-level forward someone else set, put back after
    lm_head.forward = lambda hidden: _FusedLinearCrossEntropy.apply(hidden, lm_head.weight, y, chunk_tokens)
    try:
        return lm_head(h)
    finally:
        if own is None:
            del lm_head.forward
        else:
            lm_head.forward = own


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
                                     num_segments: int = 0, with_correct: bool = False,
                                     impl: str = "fused") -> torch.Tensor:
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
        impl: ``fused`` (gradients in the forward) or ``recompute`` (logits recomputed in the
            backward); the fused form applies to the plain sum of an ``nn.Linear`` head without a
            bias when a gradient is wanted, the recomputed one to everything else.

    Returns:
        fp32 sum of the per-token losses over tokens whose label is not -100: a scalar, or
        [num_segments] with ``segments``, or [2, num_segments] (sums, correct counts) with
        ``with_correct``.
    """
    if with_correct and segments is None:
        raise ValueError("chunked_linear_cross_entropy_sum: with_correct=True needs segments")
    if impl not in LOSS_IMPLS:
        raise ValueError(f"chunked_linear_cross_entropy_sum: impl={impl!r}; expected one of {LOSS_IMPLS}")
    h = hidden.reshape(-1, hidden.shape[-1])  # [B*T, hidden]
    y = labels.reshape(-1)
    if impl == "fused" and _fused_applies(lm_head, h, segments):
        return _fused_sum(lm_head, h, y, chunk_tokens)
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
