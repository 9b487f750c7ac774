"""Native Sparse Attention: the three branches composed with per-head sigmoid gates.

    o = g_cmp * CompressedAttn(q, phi(k), phi(v)) + g_slc * SelectedAttn(q, k, v, topn(...))
        + g_swa * WindowAttn(q, k, v)

``nsa_attention`` is the functional op; ``NativeSparseAttention`` owns NSA's own parameters
(the compression maps and the gate projection) and is what msa_train puts in each layer.
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Callable, Optional

import torch
import torch.nn as nn

from flash_msa import reference
from flash_msa.compression.interface import TRITON_BRANCHES
from flash_msa.decode import nsa_decode
from flash_msa.gates import gate_combine_reference
from flash_msa.selection.interface import ALL_IMPLS, resolve_impl, run_selected
from flash_msa.utils.validation import (  # noqa: F401 (check_nsa_sizes: re-exported for msa_train's config)
    check_cu_seqlens, check_gates_range, check_nsa_sizes, check_positive_int, check_qkv, check_scale, check_tensor)
from flash_msa.utils.varlen import flatten_batch


def _check_compression(name: str, weight, pos, proj, HK: int, D: int, block: int, device) -> None:
    check_tensor(f"{name}_weight", weight, ndim=3, layout="[HK, cmp_block*D, D]")
    check_tensor(f"{name}_pos", pos, ndim=3, layout="[HK, cmp_block, D]")
    if proj is not None:
        check_tensor(f"{name}_proj", proj, ndim=3, layout="[HK, D, D]")
        if tuple(proj.shape) != (HK, D, D):
            raise ValueError(f"{name}_proj must have shape [HK={HK}, D={D}, D={D}], got {tuple(proj.shape)}")
        if proj.device != device:
            raise ValueError(f"{name}_proj must be on the device of q ({device}), got {proj.device}")
    if tuple(weight.shape) != (HK, block * D, D):
        raise ValueError(f"{name}_weight must have shape [HK={HK}, cmp_block*D={block * D}, D={D}], got {tuple(weight.shape)}")
    if tuple(pos.shape) != (HK, block, D):
        raise ValueError(f"{name}_pos must have shape [HK={HK}, cmp_block={block}, D={D}], got {tuple(pos.shape)}")
    for t, n in ((weight, f"{name}_weight"), (pos, f"{name}_pos")):
        if t.device != device:
            raise ValueError(f"{n} must be on the device of q ({device}), got {t.device}")


# The branch implementations nsa_attention composes. "reference" is plain PyTorch; the
# "triton" set holds the Triton kernels (compression/interface.py, window/interface.py).
BRANCHES = {
    "reference": SimpleNamespace(
        compress=reference.compress_kv,
        compressed_attention=reference.compressed_attention,
        select_blocks=reference.select_blocks,
        window_attention=reference.window_attention,
    ),
    "triton": TRITON_BRANCHES,
}


def _compose(branches, q, k, v, gates, k_cmp, v_cmp, cu,
             cmp_block, cmp_stride, slc_block, slc_topk, window, scale, selected_impl, uniform=None,
             deterministic=False, gather_group=None):
    """The NSA data flow on one packed stream [T, H, D]; k_cmp / v_cmp are (weight, pos, proj);
    ``selected_impl`` resolved (resolve_impl); ``uniform`` = (B, L) when the stream holds B
    sequences of L tokens each, else None; ``gather_group`` as in :func:`nsa_attention`."""
    (kw, kp, kj), (vw, vp, vj) = k_cmp, v_cmp
    k_cmp, cu_cmp = branches.compress(k, kw, kp, cu, cmp_block, cmp_stride, proj=kj)
    v_cmp, _ = branches.compress(v, vw, vp, cu, cmp_block, cmp_stride, proj=vj)
    fused = getattr(branches, "fused", None)  # the three branches and gates in one autograd Function
    if fused is not None:
        impl = fused.impl(q, k, slc_block, slc_topk, selected_impl)
        if impl is not None:
            return fused.attention(q, k, v, k_cmp, v_cmp, gates, cu, cu_cmp, cmp_block, cmp_stride, slc_block,
                                   slc_topk, window, scale, impl, uniform, deterministic, gather_group)
    o_cmp, lse = branches.compressed_attention(q, k_cmp, v_cmp, cu, cu_cmp, cmp_block, cmp_stride, scale)
    q_sel, lse_sel = q.detach(), lse.detach()
    if gather_group is not None:  # the whole GQA groups' queries, so the selection is theirs
        q_sel, lse_sel = gather_group(q_sel, lse_sel)
    idx = branches.select_blocks(q_sel, k_cmp.detach(), lse_sel, cu, cu_cmp,
                                 cmp_block, cmp_stride, slc_block, slc_topk, scale)  # [T, HK, n]
    # idx comes from our own top-k (distinct, in range): no second validation
    o_slc = run_selected(q[None], k[None], v[None], idx[None], slc_block, cu, scale, selected_impl)[0]
    o_swa = branches.window_attention(q, k, v, cu, window, scale)
    return getattr(branches, "combine", gate_combine_reference)(gates, o_cmp, o_slc, o_swa, q.dtype)


def nsa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: torch.Tensor,
    k_cmp_weight: torch.Tensor, k_cmp_pos: torch.Tensor, v_cmp_weight: torch.Tensor, v_cmp_pos: torch.Tensor, *,
    cmp_block: int = 32, cmp_stride: int = 16, slc_block: int = 64, slc_topk: int = 16, window: int = 512,
    cu_seqlens: Optional[torch.Tensor] = None, scale: Optional[float] = None, impl: str = "auto",
    k_cmp_proj: Optional[torch.Tensor] = None, v_cmp_proj: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    gather_group: Optional[Callable] = None,
) -> torch.Tensor:
    """Native Sparse Attention forward (differentiable in q, k, v, gates and the compression parameters).

    Args:
        q: [B, T, HQ, D] queries (after the model's q norm and RoPE).
        k, v: [B, T, HK, D] keys and values, HQ a multiple of HK (group 1..16).
        gates: [B, T, HQ, 3] branch gates in [0, 1] (sigmoid already applied): compressed, selected, window.
            Checked unless inside ``flash_msa.trusted_inputs()`` on an accelerator.
        k_cmp_weight, v_cmp_weight: [HK, cmp_block*D, D] first layer of the compression MLP phi.
        k_cmp_pos, v_cmp_pos: [HK, cmp_block, D] intra-block position encodings.
        k_cmp_proj, v_cmp_proj: [HK, D, D] second layer of phi, added to mean pooling (see
            compression/naive.py). None makes phi the linear map of the first layer alone.
        cmp_block, cmp_stride: compression block l and stride d (defaults 32 and 16).
        slc_block, slc_topk: selection block l' and number of selected blocks n (64 and 16,
            including block 0 and the two local blocks, which are always selected).
        window: sliding window w (512).
        cu_seqlens: optional int32 [N+1] offsets of packed sequences (then B == 1).
        scale: softmax scale, finite and positive; default 1/sqrt(D).
        impl: "reference" runs every branch in plain PyTorch; "fmsa" (KV-block-centric) or "qc"
            (query-centric) run the Triton kernels with that selected-attention loop order (on a
            CPU tensor only under TRITON_INTERPRET=1, else ValueError); "auto" runs "fmsa" on CUDA
            where the kernels take the shape, else the reference (selection.interface.resolve_impl).
        deterministic: keep compressed attention on the bitwise deterministic Triton kernels
            instead of cuDNN (whose dq accumulation order varies), also when
            ``torch.are_deterministic_algorithms_enabled()`` is False.
        gather_group: when the call holds only some query heads of each KV head's group (sequence
            parallelism with replicated KV heads): ``(q [B*T, HQ, D], lse [B*T, HQ]) -> (q, lse)``
            of all the query heads of the groups (detached, in head order; the other heads come
            from the caller's peers), so the blocks are selected from the whole group's scores.

    Returns:
        o: [B, T, HQ, D] in the dtype of q.
    """
    B, T, HQ, HK, D = check_qkv(q, k, v)
    check_cu_seqlens(cu_seqlens, B, T, q.device)
    check_tensor("gates", gates, ndim=4, layout="[B, T, HQ, 3]")
    if tuple(gates.shape) != (B, T, HQ, 3):
        raise ValueError(f"gates must have shape [B={B}, T={T}, HQ={HQ}, 3], got {tuple(gates.shape)}")
    if gates.device != q.device:
        raise ValueError(f"gates must be on the device of q ({q.device}), got {gates.device}")
    check_gates_range(gates)
    check_nsa_sizes(cmp_block, cmp_stride, slc_block, slc_topk, window)
    _check_compression("k_cmp", k_cmp_weight, k_cmp_pos, k_cmp_proj, HK, D, cmp_block, q.device)
    _check_compression("v_cmp", v_cmp_weight, v_cmp_pos, v_cmp_proj, HK, D, cmp_block, q.device)
    scale = check_scale(scale, D)
    impl = resolve_impl(impl, q, k, slc_topk, slc_block)
    branches = BRANCHES["reference" if impl == "reference" else "triton"]
    qf, cu = flatten_batch(q, cu_seqlens)
    # B sequences of T tokens, or one: known on the host (no look at cu_seqlens' values)
    uniform = (B, T) if cu_seqlens is None or cu_seqlens.numel() == 2 else None
    o = _compose(branches, qf, k.reshape(B * T, HK, D), v.reshape(B * T, HK, D), gates.reshape(B * T, HQ, 3),
                 (k_cmp_weight, k_cmp_pos, k_cmp_proj), (v_cmp_weight, v_cmp_pos, v_cmp_proj), cu,
                 cmp_block, cmp_stride, slc_block, slc_topk, window, scale, impl, uniform=uniform,
                 deterministic=deterministic, gather_group=gather_group)
    return o.view(B, T, HQ, D)


class Compression(nn.Module):
    """phi for one of k or v: per-KV-head MLP over a block's keys, with a position encoding and a
    mean-pooling skip path (compression/naive.py has the formula)."""

    def __init__(self, num_kv_heads: int, head_dim: int, block: int, device=None, dtype=None):
        super().__init__()
        self.block = block
        self.weight = nn.Parameter(torch.empty(num_kv_heads, block * head_dim, head_dim, device=device, dtype=dtype))
        self.pos = nn.Parameter(torch.empty(num_kv_heads, block, head_dim, device=device, dtype=dtype))
        self.proj = nn.Parameter(torch.empty(num_kv_heads, head_dim, head_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # proj = 0 makes phi mean pooling at step 0, plus the mean of the small position encodings
        # (about 0.004 per element): a pretrained model's compressed keys start as (nearly) the
        # average of its real keys, so the compressed branch is meaningful at once. weight gets small
        # random values so that proj receives gradient from the first step.
        with torch.no_grad():
            nn.init.normal_(self.weight, std=self.weight.shape[1] ** -0.5)
            nn.init.normal_(self.pos, std=0.02)
            self.proj.zero_()


class NativeSparseAttention(nn.Module):
    """NSA's own parameters and the call into :func:`nsa_attention`.

    Parameters: ``compress_k.weight`` / ``compress_v.weight`` [HK, cmp_block*D, D],
    ``compress_k.pos`` / ``compress_v.pos`` [HK, cmp_block, D], ``compress_k.proj`` /
    ``compress_v.proj`` [HK, D, D], ``gate.weight`` [3*HQ, hidden] and ``gate.bias`` [3*HQ]
    (rows ordered branch-major: compressed, selected, window).

    Initialisation: phi starts as mean pooling of the block (proj = 0); the gate
    weights start at 0 and the biases at -ln 2, so every gate starts at 1/3 and the output is
    the mean of the three branches. For a sequence shorter than the window, the window and
    selected branches both equal full causal attention, so a dense model keeps most of its
    behaviour at step 0.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 cmp_block: int = 32, cmp_stride: int = 16, slc_block: int = 64, slc_topk: int = 16,
                 window: int = 512, impl: str = "auto", deterministic: bool = False, device=None, dtype=None):
        super().__init__()
        check_nsa_sizes(cmp_block, cmp_stride, slc_block, slc_topk, window)
        for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            check_positive_int(name, value)
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if impl not in ALL_IMPLS:
            raise ValueError(f"impl must be one of {ALL_IMPLS}, got {impl!r}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sizes = dict(cmp_block=cmp_block, cmp_stride=cmp_stride, slc_block=slc_block,
                          slc_topk=slc_topk, window=window)
        self.impl = impl
        self.deterministic = deterministic  # nsa_attention's deterministic: no cuDNN compressed attention
        self.compress_k = Compression(num_kv_heads, head_dim, cmp_block, device, dtype)
        self.compress_v = Compression(num_kv_heads, head_dim, cmp_block, device, dtype)
        self.gate = nn.Linear(hidden_size, 3 * num_heads, bias=True, device=device, dtype=dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.compress_k.reset_parameters()
        self.compress_v.reset_parameters()
        with torch.no_grad():
            self.gate.weight.zero_()
            self.gate.bias.fill_(-math.log(2.0))

    def forward(self, hidden_states: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cu_seqlens: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                sequence_parallel=None) -> torch.Tensor:
        """hidden_states [B, T, hidden], q [B, T, HQ, D], k/v [B, T, HK, D] -> [B, T, HQ, D].

        ``sequence_parallel`` (Ulysses; msa_train.parallel.sequence.SequenceParallel, or any object
        with ``size``, the exchanges ``to_heads`` / ``kv_to_heads`` / ``to_sequence(x, seq_dim,
        head_dim)``, ``kv_shard(p, dim)`` (the rank's rows of a per-KV-head tensor) and
        ``gather_group(num_kv_heads)`` (None, or :func:`nsa_attention`'s ``gather_group``)): the
        inputs hold this rank's T tokens of a sequence of ``size * T`` tokens, and ``cu_seqlens``
        describes the whole sequence. The gates are computed on the rank's tokens; q, k, v and the
        gates are exchanged so that the rank attends over the whole sequence with its ``HQ/size``
        query heads and the KV heads they need (with the compression parameters of those), and the
        output comes back to its tokens.
        """
        gates = self._gates(hidden_states, q)
        params = [self.compress_k.weight, self.compress_k.pos, self.compress_v.weight, self.compress_v.pos,
                  self.compress_k.proj, self.compress_v.proj]
        sp, gather = sequence_parallel, None
        if sp is not None and sp.size > 1:
            HQ, HK = self.num_heads, self.num_kv_heads
            if HQ % sp.size or (HK % sp.size and sp.size % HK):
                raise ValueError(f"sequence parallelism over {sp.size} ranks needs num_heads ({HQ}) to be a multiple "
                                 f"of {sp.size}, and num_kv_heads ({HK}) a multiple or a divisor of it")
            q, gates = (sp.to_heads(x, seq_dim=1, head_dim=2) for x in (q, gates))
            k, v = (sp.kv_to_heads(x, seq_dim=1, head_dim=2) for x in (k, v))
            params = [sp.kv_shard(p, 0) for p in params]  # this rank's KV heads
            gather = sp.gather_group(HK)
        kw, kp, vw, vp, kj, vj = params
        o = nsa_attention(q, k, v, gates, kw, kp, vw, vp, cu_seqlens=cu_seqlens, scale=scale, impl=self.impl,
                          k_cmp_proj=kj, v_cmp_proj=vj, deterministic=self.deterministic, gather_group=gather, **self.sizes)
        if sp is not None and sp.size > 1:
            o = sp.to_sequence(o, seq_dim=1, head_dim=2)
        return o

    def _gates(self, hidden_states: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Per-head branch gates [B, T, HQ, 3] (fp32, sigmoid applied) from hidden_states [B, T, hidden]."""
        check_tensor("hidden_states", hidden_states, ndim=3, layout="[B, T, hidden]")
        hidden = self.gate.in_features
        if tuple(hidden_states.shape[:2]) != tuple(q.shape[:2]) or hidden_states.shape[2] != hidden:
            raise ValueError(f"hidden_states must have shape [B, T, hidden={hidden}] with B, T of q "
                             f"{tuple(q.shape[:2])}, got {tuple(hidden_states.shape)}")
        B, T = q.shape[:2]
        logits = self.gate(hidden_states)  # [B, T, 3*HQ]; called as a module, so an adapter on it (LoRA) applies
        return torch.sigmoid(logits.float()).view(B, T, 3, self.num_heads).transpose(-1, -2)  # [B, T, HQ, 3]

    def decode(self, hidden_states: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: Optional[float] = None, cache=None, impl: str = "auto") -> torch.Tensor:
        """Decoding with a KV cache: hidden_states [B, Tq, hidden] and q [B, Tq, HQ, D] of the last Tq
        positions, k/v [B, Tk, HK, D] of all Tk positions -> [B, Tq, HQ, D], the rows that
        :meth:`forward` on the whole sequences gives those positions. ``cache`` (a
        :class:`flash_msa.decode.DecodeCache`) keeps the compressed keys and values between steps;
        ``impl`` picks the Triton kernel or PyTorch (flash_msa/decode/)."""
        k_cmp = (self.compress_k.weight, self.compress_k.pos, self.compress_k.proj)
        v_cmp = (self.compress_v.weight, self.compress_v.pos, self.compress_v.proj)
        return nsa_decode(q, k, v, self._gates(hidden_states, q), k_cmp, v_cmp, scale=scale, cache=cache, impl=impl,
                          **self.sizes)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.sizes.items()) + f", impl={self.impl}"
