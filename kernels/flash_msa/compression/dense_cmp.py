"""Compressed attention as dense causal GQA attention over query groups (cuDNN on CUDA).

Query token ``t = s0 + l - 1 + d*i + j`` (``0 <= j < d``) of a sequence starting at ``s0`` sees
the compressed rows ``0..i`` of its sequence (the rule ``i*d + l - 1 <= t_rel``): the d tokens of
"group" i all see the same keys. Taking the d tokens of group i, times the HQ query heads, as
d*HQ query heads of one position i turns compressed attention into plain causal attention over
the Tc compressed positions, which a dense attention library runs at its own speed: cuDNN's fused
attention through PyTorch's private ``_scaled_dot_product_cudnn_attention`` op, which returns
the lse. Query head ``j*HQ + h`` at position i is token ``l - 1 + d*i + j``, head h: the groups
are a strided view of the token rows (no copy of q, do or o), and its KV head
``(j*HQ + h) // G = j*HK + k`` holds a copy of KV head k (the compressed keys and values are
repeated once per token offset j of a call). A sequence's last group is short unless ``(L - l) % d == d - 1``;
its tokens (fewer than d) run on the Triton range kernel, and the first ``l - 1`` tokens, which
see nothing, get o = 0 and lse = -inf.

This needs every sequence of the stream to have the same length L (a dense batch, or one
sequence per stream): PyTorch's varlen cuDNN path (``cum_seq_q``) ran this shape 20x slower than
the batched one and its gradients came back NaN in our calls (H200, torch 2.11, cuDNN 9.19;
a one-off probe, benchmarks/results/probes/results.md#cmp_cudnn_probe), and padding a packed
stream to a batch would need its lengths on the host. Packed streams keep the Triton range
kernels (window/window.py).

The backward takes the single Function's form (flash_msa/fused.py): cuDNN computes
``delta = rowsum(out * do)`` itself, so it gets ``out = o_cmp`` (whose rowsum with ``do`` is that
form's ``r_cmp``) and ``lse' = lse - log g``, clamped to 1e30 where the gate is 0 (``exp(s - 1e30)``
is 0, as is the +inf of the Triton kernels).

cuDNN accumulates dq non-deterministically, so it runs only when the caller does not ask for a
deterministic backward (``deterministic=False``, the argument of ``nsa_attention``) and
``torch.are_deterministic_algorithms_enabled()`` is False; otherwise compressed attention runs the
deterministic Triton kernels. Settings (op ``"dense_cmp"`` of flash_msa.tuning): ``SETTINGS``.
"""
from __future__ import annotations

import functools
from types import MappingProxyType
from typing import Optional

import torch
import triton
import triton.language as tl

from flash_msa import tuning
from flash_msa.window.window import range_attention_bwd, range_attention_fwd

# SETTINGS["backend"]: "auto": cuDNN where it runs (see cudnn_supported) and the stream is uniform
# with at least min_groups compressed rows per sequence; "triton": always the range kernels;
# "cudnn": cuDNN wherever it runs; "math": the dense grouped form in plain PyTorch (O(Tc^2) memory:
# for the tests, where it checks the regrouping on CPU).
BACKENDS = ("auto", "triton", "cudnn", "math")
# min_groups, the crossover in compressed rows per sequence: whole op at 16K (1023 rows) 13.1 ms on
# the range kernels against 13.7 on cuDNN, at 32K (2047) 26.5 against 25.4 (nsa_h200_229b0a5.md,
# --compare-cmp)
LSE_CLAMP = 1e30  # stands for +inf (a zero gate) in the lse given to the backward
# offsets_per_call: the dense calls' transient memory (cuDNN's output and dq, its fp32 dq accumulator,
# the repeated KV heads: about 5 bytes per byte of q in one call) is split over calls that each take
# at most offsets_per_call of a group's d token offsets (query heads [c*J*HQ, (c+1)*J*HQ)). At 4 of 16,
# the whole op's peak memory equals the Triton path's at 64K and 256K (1 call: +2.2 and +9 GB; 8
# or 16 calls: up to 2.6 ms slower at 64K; benchmarks/results/probes/results.md#tune_dense_cmp).
# chunks (None: from offsets_per_call) fixes the number of calls.
SETTINGS = MappingProxyType(dict(backend="auto", min_groups=2000, offsets_per_call=4, chunks=None))
tuning.register("dense_cmp", SETTINGS)


def group_count(L: int, block: int, stride: int) -> int:
    """Compressed rows (= query groups) of a sequence of L tokens."""
    return (L - block) // stride + 1 if L >= block else 0


def cudnn_supported(q: torch.Tensor) -> bool:
    """Whether cuDNN's fused attention takes these queries (dtype, head dim, enabled) on a GPU
    this was measured on (Hopper: sm90; other generations keep the range kernels)."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in (64, 128)
            and torch.backends.cudnn.is_available() and torch.backends.cuda.cudnn_sdp_enabled()
            and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")
            and torch.cuda.get_device_capability(q.device)[0] == 9)


def dense_layout(q: torch.Tensor, uniform: Optional[tuple[int, int]], block: int, stride: int,
                 deterministic: bool = False) -> Optional[tuple[int, int, str]]:
    """(B, L, kernel) when compressed attention runs in the dense grouped form (kernel "cudnn", or
    "math" for the tests), else None (the Triton range kernels).

    ``uniform`` is (B, L) when the stream [B*L] holds B sequences of L tokens each (known on the
    host: a dense batch, or cu_seqlens of one sequence), else None. ``deterministic`` keeps the
    bitwise deterministic range kernels (cuDNN's dq is not).
    """
    cfg = tuning.settings("dense_cmp", SETTINGS)
    backend = cfg["backend"]
    if backend not in BACKENDS:
        raise ValueError(f"dense_cmp backend must be one of {BACKENDS}, got {backend!r}")
    if uniform is None or backend == "triton" or group_count(uniform[1], block, stride) < 1:
        return None
    if backend == "math":
        return (*uniform, "math")
    # cuDNN's backward rejects a dense call of one position (s_q = s_kv = 1)
    if split_groups(uniform[1], block, stride)[1] < 2:
        return None
    if deterministic or torch.are_deterministic_algorithms_enabled() or not cudnn_supported(q):
        return None
    if backend == "cudnn" or group_count(uniform[1], block, stride) >= cfg["min_groups"]:
        return (*uniform, "cudnn")
    return None


# ----------------------------------------------------------------------------------------------
# query groups as strided views of the token rows


def split_groups(L: int, block: int, stride: int) -> tuple[int, int, int]:
    """(Tc, S, n_last): compressed rows, groups of the dense call, tokens of the last group.

    The dense call takes the S groups whose d tokens all exist: all Tc when the last group is
    full, else the first Tc - 1; the short last group (n_last < d tokens) goes to the range kernel.
    """
    Tc = group_count(L, block, stride)
    n_last = L - (block - 1) - stride * (Tc - 1)
    return Tc, (Tc if n_last == stride else Tc - 1), n_last


def group_view(x: torch.Tensor, B: int, L: int, block: int, stride: int, S: int) -> torch.Tensor:
    """The rows of the first S groups of x [B*L, HQ, *rest] as a view [B, d*HQ, S, *rest]: head
    ``j*HQ + h`` at position i is token ``l - 1 + d*i + j`` of head h (memory stays [B, S, d*HQ])."""
    HQ, rest = x.shape[1], x.shape[2:]
    rows = x.view(B, L, HQ, *rest)[:, block - 1:block - 1 + stride * S]
    return rows.view(B, S, stride * HQ, *rest).transpose(1, 2)


def _kv_groups(x: torch.Tensor, B: int, Tc: int, S: int, stride: int) -> torch.Tensor:
    """Packed compressed rows [T//d, HK, D] -> [B, J*HK, S, D] for J token offsets (``stride``
    here): KV head ``j*HK + k`` is KV head k (query head ``j*HQ + h`` maps to
    ``(j*HQ + h) // G = j*HK + k``). A copy, J times the rows' size: the query groups are views,
    so the KV heads repeat."""
    HK, D = x.shape[1:]
    rep = x[:B * Tc].view(B, Tc, 1, HK, D)[:, :S].expand(B, S, stride, HK, D)
    return rep.reshape(B, S, stride * HK, D).transpose(1, 2)


def chunk_count(stride: int) -> int:
    """Calls the dense part runs in: d / J for the largest J <= offsets_per_call dividing d."""
    cfg = tuning.settings("dense_cmp", SETTINGS)
    chunks = cfg["chunks"]
    if chunks is not None:
        if stride % chunks:
            raise ValueError(f"dense_cmp chunks ({chunks}) must divide cmp_stride ({stride})")
        return chunks
    J = max(j for j in range(1, min(cfg["offsets_per_call"], stride) + 1) if stride % j == 0)
    return stride // J


@functools.lru_cache(maxsize=16)
def _last_group_ranges(B: int, Tc: int, n_last: int, Tk: int, device: torch.device) -> tuple:
    """Range-kernel ranges of the last groups: token j of sequence b's last group sees the rows
    [b*Tc, (b+1)*Tc); key row r < B*Tc is seen by the last-group tokens [b*n_last, (b+1)*n_last)."""
    tok = torch.arange(B * n_last, device=device) // n_last
    r = torch.arange(Tk, device=device)
    rb = r // Tc
    valid = r < B * Tc
    i32 = torch.int32
    return ((tok * Tc).to(i32), (tok * Tc + Tc).to(i32),
            torch.where(valid, rb * n_last, 0).to(i32), torch.where(valid, rb * n_last + n_last, 0).to(i32))


@triton.jit
def _copy_heads_kernel(src, dst, S, H, s_b, s_h, s_s, d_b, d_h, d_s, D: tl.constexpr, BH: tl.constexpr):
    # one (b, s) row and BH heads of [B, H, S, D] tensors whose D is contiguous
    i_bs = tl.program_id(0).to(tl.int64)
    i_b, i_s = i_bs // S, i_bs % S
    o_h = tl.program_id(1) * BH + tl.arange(0, BH)
    o_d = tl.arange(0, D)
    m = (o_h < H)[:, None]
    x = tl.load(src + i_b * s_b + i_s * s_s + o_h.to(tl.int64)[:, None] * s_h + o_d[None, :], mask=m)
    tl.store(dst + i_b * d_b + i_s * d_s + o_h.to(tl.int64)[:, None] * d_h + o_d[None, :], x, mask=m)


def copy_heads(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for [B, H, S, D] views with a contiguous D, such as cuDNN's output into the
    query groups' view. Written by hand: PyTorch copies between these strided views with its
    generic elementwise kernel, 1.41 ms for the 12 copies (o, dq, lse) of one forward + backward
    at 64K (benchmarks/results/profile/variants.md#profile_nsa_64k_pre_copy_heads); this kernel takes 0.56 ms
    for the 8 of o and dq (profile/latest.log)."""
    B, H, S, D = dst.shape
    if src.shape != dst.shape or src.dtype != dst.dtype or dst.stride(3) != 1 or src.stride(3) != 1:
        raise ValueError(f"copy_heads takes two [B, H, S, D] tensors of one dtype with a contiguous D, "
                         f"got {tuple(dst.shape)} {dst.dtype} and {tuple(src.shape)} {src.dtype}")
    if D & (D - 1):  # tl.arange needs a power of two; the kernels' head dims are
        dst.copy_(src)
        return
    BH = max(1, min(triton.next_power_of_2(H), 8192 // D))
    _copy_heads_kernel[(B * S, triton.cdiv(H, BH))](
        src, dst, S, H, src.stride(0), src.stride(1), src.stride(2), dst.stride(0), dst.stride(1), dst.stride(2),
        D=D, BH=BH)


@triton.jit
def _add_head_copies_kernel(src, dst, S, s_b, s_h, s_s, d_b, d_h, d_s, J: tl.constexpr, H: tl.constexpr,
                            BH: tl.constexpr, D: tl.constexpr):
    # one (b, s) row: dst[b, h, s] (fp32) += sum over j of src[b, j*H + h, s], for the H heads
    i_bs = tl.program_id(0).to(tl.int64)
    i_b, i_s = i_bs // S, i_bs % S
    o_h = tl.arange(0, BH)
    o_d = tl.arange(0, D)
    m = (o_h < H)[:, None]
    p_dst = dst + i_b * d_b + i_s * d_s + o_h.to(tl.int64)[:, None] * d_h + o_d[None, :]
    acc = tl.load(p_dst, mask=m, other=0.)
    for j in tl.static_range(J):
        acc += tl.load(src + i_b * s_b + i_s * s_s + (j * H + o_h).to(tl.int64)[:, None] * s_h + o_d[None, :],
                       mask=m, other=0.).to(tl.float32)
    tl.store(p_dst, acc, mask=m)


def add_head_copies(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst += src.unflatten(1, (J, H)).sum(1)`` in fp32 for dst [B, H, S, D] (fp32) and src
    [B, J*H, S, D] with a contiguous D: cuDNN's dk / dv of the repeated KV heads of one call summed
    into the compressed keys' gradient. Written by hand: in PyTorch that is a strided reduction into
    an fp32 temporary and an add per tensor and call (at 64K on the H200 the strided bf16 reductions took
    0.25 ms in 12 launches, benchmarks/results/profile/variants.md#profile_nsa_64k_3d7bbd1); this reads src once and
    dst once (0.15 ms in 8 launches, profile/latest.log)."""
    B, H, S, D = dst.shape
    if (src.shape[0], src.shape[2:]) != (B, (S, D)) or src.shape[1] % H or dst.dtype != torch.float32 \
            or dst.stride(3) != 1 or src.stride(3) != 1:
        raise ValueError(f"add_head_copies takes fp32 dst [B, H, S, D] and src [B, J*H, S, D] with a contiguous D, "
                         f"got {tuple(dst.shape)} {dst.dtype} strides {dst.stride()} and "
                         f"{tuple(src.shape)} {src.dtype} strides {src.stride()}")
    J = src.shape[1] // H
    if D & (D - 1):  # tl.arange needs a power of two; the kernels' head dims are
        dst += src.unflatten(1, (J, H)).sum(1, dtype=torch.float32)
        return
    _add_head_copies_kernel[(B * S,)](
        src, dst, S, src.stride(0), src.stride(1), src.stride(2), dst.stride(0), dst.stride(1), dst.stride(2),
        J=J, H=H, BH=triton.next_power_of_2(H), D=D)


# ----------------------------------------------------------------------------------------------
# dense causal GQA attention on [B, H, S, D]: cuDNN, or plain PyTorch (tests)


def _math_scores(q4, k4, scale):
    """fp32 causal scores [B, HK, G', S, S] of q4 [B, HK*G', S, D] against k4 [B, HK, S, D]."""
    HK = k4.shape[1]
    s = (q4.float().unflatten(1, (HK, -1)) @ k4.float()[:, :, None].transpose(-1, -2)) * scale
    S = s.shape[-1]
    return s.masked_fill(~torch.ones(S, S, dtype=torch.bool, device=s.device).tril(), float("-inf"))


def _math_fwd(q4, k4, v4, scale):
    s = _math_scores(q4, k4, scale)
    lse = torch.logsumexp(s, -1)
    o = torch.exp(s - lse[..., None]) @ v4.float()[:, :, None]
    return o.flatten(1, 2).to(q4.dtype), lse.flatten(1, 2)[..., None], None


def _math_bwd(do4, q4, k4, v4, o4, lse4, scale, aux):
    HK = k4.shape[1]
    qf, dof = (x.float().unflatten(1, (HK, -1)) for x in (q4, do4))
    kf, vf = (x.float()[:, :, None] for x in (k4, v4))
    p = torch.exp(_math_scores(q4, k4, scale) - lse4.float().unflatten(1, (HK, -1)))  # the given lse, as cuDNN
    delta = (o4.float() * do4.float()).sum(-1).unflatten(1, (HK, -1))[..., None]
    ds = p * (dof @ vf.transpose(-1, -2) - delta)
    dq = (ds @ kf) * scale
    dk = (ds.transpose(-1, -2) @ qf).sum(2) * scale
    dv = (p.transpose(-1, -2) @ dof).sum(2)
    return dq.flatten(1, 2).to(q4.dtype), dk.to(k4.dtype), dv.to(v4.dtype)


def _cudnn_fwd(q4, k4, v4, scale):
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(q4, k4, v4, None, True, 0.0, True, False, scale=scale)
    o4, lse4 = r[0], r[1]
    return o4, lse4.reshape(*q4.shape[:3], 1), (r[6], r[7], lse4.shape)  # lse [B, H, S, 1]


def _cudnn_bwd(do4, q4, k4, v4, o4, lse4, scale, aux):
    seed, offset, lse_shape = aux
    S = q4.shape[2]
    dq4, dk4, dv4 = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do4, q4, k4, v4, o4, lse4.view(lse_shape), seed, offset, None, None, None, S, S, 0.0, True, scale=scale)
    return dq4, dk4, dv4


def _attention(kernel: str):
    return (_math_fwd, _math_bwd) if kernel == "math" else (_cudnn_fwd, _cudnn_bwd)


def dense_cmp_forward(q, k_cmp, v_cmp, layout, block: int, stride: int, scale: float):
    """Compressed attention of a uniform stream (``layout`` = (B, L, kernel) from :func:`dense_layout`).

    Returns (o [T, HQ, D] in q's dtype, lse fp32 [T, HQ] natural log, -inf where nothing is
    visible, aux for :func:`dense_cmp_backward`): the contract of the range kernels.
    """
    B, L, kernel = layout
    T, HQ, D = q.shape
    Tc, S, n_last = split_groups(L, block, stride)
    o = q.new_empty(B, L, HQ, D)
    lse = torch.empty(B, L, HQ, dtype=torch.float32, device=q.device)
    o[:, :block - 1] = 0
    lse[:, :block - 1] = float("-inf")
    o, lse = o.view(T, HQ, D), lse.view(T, HQ)
    aux = []
    if S > 0:
        n = chunk_count(stride)
        J = stride // n  # token offsets per call: query heads [c*J*HQ, (c+1)*J*HQ) of the groups
        k4, v4 = _kv_groups(k_cmp, B, Tc, S, J), _kv_groups(v_cmp, B, Tc, S, J)  # the same for every call
        q4, o_g = group_view(q, B, L, block, stride, S), group_view(o, B, L, block, stride, S)
        lse_g = group_view(lse, B, L, block, stride, S)
        for c in range(n):  # a few calls that bound the memory (chunk_count), not a loop over heads
            h = slice(c * J * HQ, (c + 1) * J * HQ)
            o4, lse4, a = _attention(kernel)[0](q4[:, h], k4, v4, scale)
            copy_heads(o_g[:, h], o4)
            lse_g[:, h].copy_(lse4.reshape(B, J * HQ, S))
            aux.append(a)
            del o4, lse4
    if S < Tc:  # the short last group of each sequence, on the range kernel
        lo, hi, _, _ = _last_group_ranges(B, Tc, n_last, k_cmp.shape[0], q.device)
        q_last = q.view(B, L, HQ, D)[:, L - n_last:].reshape(B * n_last, HQ, D).contiguous()  # the kernels' layout
        o_l, lse_l = range_attention_fwd(q_last, k_cmp, v_cmp, lo, hi, scale, "cmp")
        o.view(B, L, HQ, D)[:, L - n_last:] = o_l.view(B, n_last, HQ, D)
        lse.view(B, L, HQ)[:, L - n_last:] = lse_l.view(B, n_last, HQ)
    return o, lse, aux


def dense_cmp_backward(q, k_cmp, v_cmp, o, lse, do, layout, block: int, stride: int, scale: float, aux,
                       delta: Optional[torch.Tensor] = None):
    """Gradients (dq [T, HQ, D], dk_cmp, dv_cmp) of :func:`dense_cmp_forward` for the output
    gradient ``do``, with the softmax lse given as ``lse`` ([T, HQ]; lse - log(gate) in the single
    Function, +inf allowed) and ``delta = rowsum(o * do)`` (given, or computed here). Tokens
    in no group get dq = 0, and packed rows past the B sequences get dk = dv = 0."""
    B, L, kernel = layout
    T, HQ, D = q.shape
    HK = k_cmp.shape[1]
    Tc, S, n_last = split_groups(L, block, stride)
    dq = q.new_empty(B, L, HQ, D)
    dq[:, :block - 1] = 0
    dq = dq.view(T, HQ, D)
    # the parts (each call's dk/dv, rounded to k's dtype by cuDNN, and the last group's) add in fp32
    dk = torch.zeros(k_cmp.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v_cmp.shape, dtype=torch.float32, device=q.device)
    if S > 0:
        g = dict(B=B, L=L, block=block, stride=stride, S=S)
        n = len(aux)
        J = stride // n
        k4, v4 = _kv_groups(k_cmp, B, Tc, S, J), _kv_groups(v_cmp, B, Tc, S, J)
        q4, do4, o4, dq_g = (group_view(x, **g) for x in (q, do, o, dq))
        lse_g = group_view(lse, **g)
        dk_g, dv_g = (x[:B * Tc].view(B, Tc, HK, D)[:, :S].transpose(1, 2) for x in (dk, dv))  # [B, HK, S, D]
        for c in range(n):
            h = slice(c * J * HQ, (c + 1) * J * HQ)
            lse4 = torch.empty(B, J * HQ, S, 1, dtype=torch.float32, device=q.device)
            # defensive: cuDNN 9.19 took +inf as well (exp(s - inf) = 0), the clamp gives the same
            torch.clamp(lse_g[:, h], max=LSE_CLAMP, out=lse4.view(B, J * HQ, S))
            dq4, dk4, dv4 = _attention(kernel)[1](do4[:, h], q4[:, h], k4, v4, o4[:, h], lse4, scale, aux[c])
            copy_heads(dq_g[:, h], dq4)
            add_head_copies(dk_g, dk4)
            add_head_copies(dv_g, dv4)
            del dq4, dk4, dv4, lse4
    if S < Tc:  # the short last groups, on the range kernel (its dq written, its dk/dv added)
        ranges = _last_group_ranges(B, Tc, n_last, k_cmp.shape[0], q.device)
        last = (slice(None), slice(L - n_last, L))
        q_l, do_l = (x.view(B, L, HQ, D)[last].reshape(B * n_last, HQ, D).contiguous() for x in (q, do))
        lse_l = lse.view(B, L, HQ)[last].reshape(B * n_last, HQ)
        if delta is None:
            delta_l = (o.view(B, L, HQ, D)[last].float() * do_l.view(B, n_last, HQ, D).float()).sum(-1)
        else:
            delta_l = delta.view(B, L, HQ)[last]
        delta_l = delta_l.reshape(B * n_last, HQ)
        dq_l, dk_l, dv_l = range_attention_bwd(q_l, k_cmp, v_cmp, None, lse_l.contiguous(), do_l, None, *ranges,
                                               scale, "cmp", delta=delta_l.contiguous())
        dq.view(B, L, HQ, D)[last] = dq_l.view(B, n_last, HQ, D)
        dk += dk_l
        dv += dv_l
    return dq, dk.to(k_cmp.dtype), dv.to(v_cmp.dtype)
