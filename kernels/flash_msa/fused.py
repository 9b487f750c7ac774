"""NSA's three attention branches and their gated combination as one autograd Function.

Composed from one autograd Function per branch and one for the gates, the backward writes each
branch's output gradient ``g_b * do`` (three [T, HQ, D] tensors), reads each back with ``o_b``
for the branch's softmax correction ``rowsum(o_b * g_b * do)``, and autograd adds the branches'
dq. This backward needs none of that:

1. one kernel reads ``do`` and the three outputs once and writes the gates' gradient and, per
   branch, ``r_b = rowsum(o_b * do)`` and ``lse'_b = lse_b - log g_b`` ([T, HQ] each);
2. each branch's unchanged backward runs on ``do`` itself with ``lse'_b`` and delta ``r_b``:
   its probabilities are then ``g_b * p_b``, so dv, ``ds = g_b p_b (do v^T - r_b)`` and hence
   dq and dk are exactly those of ``g_b * do``;
3. compressed attention writes dq, and the window and selected attention add theirs to it
   (loaded, added in fp32, stored in dq's dtype: the rounding of autograd's sum), in that fixed
   order: deterministic. Selected attention adds its fp32 dk, dv to the window's the same way.

The forward runs the same kernels as the composed path; what the backward keeps is the same
but the three branch output gradients and their sums are never materialised, so the peak memory
of a forward + backward is lower. Compression (phi) stays its own autograd Function: this one
returns the gradients of the compressed keys and values.

The local blocks in the window kernel (``local_in_window`` in ``SETTINGS``, with fmsa): top-k always selects a
query's own block and the one before (for n >= 3), and with a window of at least two blocks these
keys ``[mid, t]`` are the last keys of the query's window, whose scores the window kernel computes
anyway. So the window kernel takes them first, writes their softmax (the partial output and lse of
those two blocks) as selected attention's starting point, and goes on over the rest of the window;
fmsa leaves the two blocks out of its index and merges its partials into that starting point. In
the backward the window kernels add the selected softmax's ds on those keys (same scores, same
dp = do v^T: one exp and a few flops more per score), and fmsa's kernels skip them. fmsa then
handles 2 of its 16 entries fewer per query, with their partial round trip and causal masking.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Optional

import torch

from flash_msa import tuning
from flash_msa.compression.compressed_attention import compressed_ranges
from flash_msa.compression.dense_cmp import dense_cmp_backward, dense_cmp_forward, dense_layout
from flash_msa.compression.topk import select_blocks
from flash_msa.gates import gate_backward_branches, gate_combine_fwd
from flash_msa.selection import fmsa as _fmsa
from flash_msa.selection.interface import IMPLS
from flash_msa.utils.cache import per_batch
from flash_msa.window.window import local_ranges, range_attention_bwd, range_attention_fwd, window_ranges

# Settings of op "fused" (flash_msa.tuning). local_in_window: selected attention's local blocks in
# the window kernel (module docstring); scripts/bench_nsa.py --compare-local times it off, through
# flash_msa.tuning.override(fused=dict(local_in_window=False)). single_function: the branches and
# gates as this one Function; False runs one Function per branch (--compare-composed).
SETTINGS = MappingProxyType(dict(local_in_window=True, single_function=True))
tuning.register("fused", SETTINGS)
LOCAL_BLOCKS = 2  # the own block and the one before: what select_blocks forces besides block 0


def local_in_window(impl: str, slc_block: int, slc_topk: int, window: int) -> bool:
    """Whether the window kernel computes selected attention's local blocks: fmsa, top-k keeps
    both forced local blocks (n >= 3: block 0, own - 1 and own are forced), and the window holds
    them (w >= 2 l')."""
    return (tuning.settings("fused", SETTINGS)["local_in_window"] and impl == "fmsa" and slc_topk >= 3
            and window >= LOCAL_BLOCKS * slc_block)


def fused_impl(q: torch.Tensor, k: torch.Tensor, slc_block: int, slc_topk: int, impl: str) -> Optional[str]:
    """``impl`` (resolved: flash_msa.selection.interface.resolve_impl) when the fused op runs it: a
    Triton loop order whose kernels take the shape; else None, and the composed path runs."""
    entry = IMPLS.get(impl)
    if entry is None or entry.forward is None or not tuning.settings("fused", SETTINGS)["single_function"]:
        return None
    return impl if _fmsa.kernel_limits_error(q, slc_topk) is None else None


class NSAAttentionFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, k_cmp, v_cmp, gates, cu, cu_cmp, sizes, scale, impl, dense, gather_group):
        selected = IMPLS[impl]
        cmp_block, cmp_stride, slc_block, slc_topk, window = sizes
        q, k, v, k_cmp, v_cmp, gates = (x.contiguous() for x in (q, k, v, k_cmp, v_cmp, gates))
        T = q.shape[0]
        wr = per_batch(window_ranges, cu, T, window)
        if dense is not None:  # compressed attention as dense grouped attention (compression/dense_cmp.py)
            cr = None
            o_cmp, lse_cmp, ctx.cmp_aux = dense_cmp_forward(q, k_cmp, v_cmp, dense, cmp_block, cmp_stride, scale)
        else:
            cr = per_batch(compressed_ranges, cu, cu_cmp, T, k_cmp.shape[0], cmp_block, cmp_stride)
            o_cmp, lse_cmp = range_attention_fwd(q, k_cmp, v_cmp, cr[0], cr[1], scale, "cmp")
        # with sequence parallelism's replicated KV heads: the whole GQA groups' queries (nsa_attention)
        q_sel, lse_sel = (q, lse_cmp) if gather_group is None else gather_group(q, lse_cmp)
        idx = select_blocks(q_sel, k_cmp, lse_sel, cu, cu_cmp, cmp_block, cmp_stride, slc_block, slc_topk, scale)
        del q_sel, lse_sel
        lr = None
        if local_in_window(impl, slc_block, slc_topk, window):
            lr = per_batch(local_ranges, cu, T, slc_block)
            o_slc = torch.empty_like(q)  # the local blocks' part, then fmsa merges into it
            lse_slc = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
            o_swa, lse_swa = range_attention_fwd(q, k, v, wr[0], wr[1], scale, "window", local=(lr[0], o_slc, lse_slc))
            o_slc, lse_slc, state = _fmsa.fmsa_forward(q, k, v, idx, slc_block, cu, scale, local=LOCAL_BLOCKS,
                                                       o=o_slc, lse=lse_slc)
        else:
            o_slc, lse_slc, state = selected.forward(q, k, v, idx, slc_block, cu, scale)
            o_swa, lse_swa = range_attention_fwd(q, k, v, wr[0], wr[1], scale, "window")
        o = gate_combine_fwd(o_cmp, o_slc, o_swa, gates, q.dtype)
        ctx.save_for_backward(q, k, v, k_cmp, v_cmp, gates, o_cmp, lse_cmp, o_slc, lse_slc, o_swa, lse_swa, idx)
        ctx.cr, ctx.wr, ctx.lr, ctx.state, ctx.scale, ctx.impl = cr, wr, lr, state, scale, impl
        ctx.dense, ctx.cmp_sizes = dense, (cmp_block, cmp_stride)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, k_cmp, v_cmp, gates, o_cmp, lse_cmp, o_slc, lse_slc, o_swa, lse_swa, idx = ctx.saved_tensors
        scale = ctx.scale
        do = do.contiguous()
        # delta and the gate-shifted lse of each branch, [3, T, HQ]: compressed, selected, window
        dgates, delta, lse = gate_backward_branches(o_cmp, o_slc, o_swa, gates, do, lse_cmp, lse_slc, lse_swa)
        if ctx.dense is not None:  # cuDNN computes delta[0] = rowsum(o_cmp * do) itself
            dq, dk_cmp, dv_cmp = dense_cmp_backward(q, k_cmp, v_cmp, o_cmp, lse[0], do, ctx.dense, *ctx.cmp_sizes,
                                                    scale, ctx.cmp_aux, delta=delta[0])
        else:
            dq, dk_cmp, dv_cmp = range_attention_bwd(q, k_cmp, v_cmp, None, lse[0], do, None, *ctx.cr, scale, "cmp",
                                                     delta=delta[0])
        local = None if ctx.lr is None else (*ctx.lr, lse[1], delta[1])  # the local blocks' selected softmax
        dq, dk, dv = range_attention_bwd(q, k, v, None, lse[2], do, None, *ctx.wr, scale, "window",
                                         delta=delta[2], dq=dq, local=local)
        dq, dk, dv = IMPLS[ctx.impl].backward(q, k, v, lse[1], idx, ctx.state, scale, do, delta[1], dq=dq, dkv=(dk, dv))
        return dq, dk, dv, dk_cmp, dv_cmp, dgates, None, None, None, None, None, None, None


def nsa_attention_fused(q, k, v, k_cmp, v_cmp, gates, cu, cu_cmp, cmp_block: int, cmp_stride: int, slc_block: int,
                        slc_topk: int, window: int, scale: float, impl: str,
                        uniform: Optional[tuple[int, int]] = None, deterministic: bool = False, gather_group=None) -> torch.Tensor:
    """The gated sum of the three branches on one packed stream ([T, H, D]; k_cmp / v_cmp packed
    compressed rows, cu_cmp their offsets), ``impl`` from :func:`fused_impl`. ``uniform`` = (B, L)
    when the stream holds B sequences of L tokens each (then compressed attention may run on
    cuDNN: compression/dense_cmp.py, unless ``deterministic``); ``gather_group`` as in
    :func:`flash_msa.nsa.nsa_attention`. Differentiable in q, k, v, k_cmp,
    v_cmp and gates."""
    dense = dense_layout(q, uniform, cmp_block, cmp_stride, deterministic)
    return NSAAttentionFunction.apply(q, k, v, k_cmp, v_cmp, gates, cu, cu_cmp,
                                      (cmp_block, cmp_stride, slc_block, slc_topk, window), scale, impl, dense,
                                      gather_group)
