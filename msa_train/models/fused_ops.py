"""The decoder's RMSNorms, RoPE and SwiGLU as single Triton kernels, forward and backward (``parallel.fused_ops``).

HF's RMSNorm runs its row through about six elementwise passes over fp32 copies (the cast, the
square, the mean, the scale, the cast back, the weight), and autograd as many again in the
backward. Its RoPE (``q * cos + rotate_half(q) * sin``, and the same for k) takes four passes and a
concatenation over [B, H, T, D] views of [B, T, H, D] storage, which PyTorch's elementwise kernels
do not vectorise. In a profiled 256K-token step of four Llama-3-8B layers the elementwise and
reduction kernels outside the matmuls, attention and the loss (these, SwiGLU's, the residual adds,
dtype copies) took 1.2 s of 7.8 s of device time
(benchmarks/results/profile_step/fmsa.md). Here each of the three is
one kernel that reads its input once and writes its output once:

* RMSNorm (Llama, Qwen2, Qwen3, including Qwen3's per-head q/k norms): HF's arithmetic, the row in
  fp32 and the normalised row rounded to the input's dtype before the weight multiplies it. The
  backward keeps the input and one fp32 ``rstd`` per row; the weight's gradient is summed in fp32
  per program, then over the programs (deterministic, no atomics). It keeps only its input, as
  ``parallel.tile_tokens``'s recomputed norm does, so the tiled norm is not applied to these.
* RoPE: the HF module's ``apply_rotary_pos_emb`` for q and k, in fp32 and rounded once. HF rounds
  each product and the sum in the model's dtype, so where the two products nearly cancel its
  result can be many units in the last place from the exact one; the kernel's is the closer.
  The backward is the same rotation by minus the angle.
* SwiGLU (``down(silu(gate(x)) * up(x))`` of the Llama / Qwen MLPs): ``silu(g) * u`` in fp32,
  rounded once, saving g and u (HF keeps silu(g) as well); the backward recomputes the sigmoid.
  Under ``parallel.tile_tokens`` the tiled MLP runs it tile by tile.

Why by hand and not liger-kernel's (the decision rule: take liger's where it is within 5% of ours).
Measured against liger-kernel 0.8.5 on an H100 (Llama-3-8B shapes, 64K tokens, forward + backward,
bf16, do_bench medians; benchmarks/results/fused_ops/liger_h100.md):

* RMSNorm: ours 0.95 ms, liger's 1.30. Ours is 1.37x faster, so it stays.
* RoPE: ours 0.95 ms, liger's 0.92 (3%). SwiGLU: ours 2.45 ms, liger's 2.44 (0.4%). Both are within
  the 5%. Ours stay for three reasons:
  - CI checks every kernel against its reference under Triton's CPU interpreter. There liger's
    SwiGLU does not run (it calls ``.to`` on a scalar argument: ``gate_multiplier.to``), and its
    RoPE returns NaN in bf16 (0.8.5, Triton 3.6); ours run and are checked.
  - Ours are the closer to fp32 (relative RMS 1.7e-3 for both, liger's 2.0e-3 and 2.3e-3): liger
    rounds like HF, ``silu(g)`` to the model's dtype before the product, RoPE in the dtype of
    cos/sin (bf16 under HF), where ours compute in fp32 and round once.
  - Liger's RoPE writes into q and k in place.
* The fused linear cross-entropy (msa_train/loss.py) over 16K tokens: ours 78.9 ms, liger's 93.6
  (ours 1.19x faster).

:func:`fuse_token_ops` patches one model: its norms' and MLPs' forwards, and its
attention modules' forwards, which mark (a context variable) that the RoPE applied while they run is
to be fused. The HF module's ``apply_rotary_pos_emb`` is replaced once by a dispatcher that runs the
kernel for those calls and HF's function for everything else. (Not a mark on the cos/sin tensors:
under ZeRO-3 DeepSpeed's module hooks hand on detached copies of every module output.)

The kernels run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (the tests);
elsewhere, and for shapes they do not cover, HF's code runs.
"""
from __future__ import annotations

import contextvars
import functools
import inspect
import os
import sys

import torch
import torch.nn as nn
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

# True while a patched attention module runs (its RoPE calls take the kernel)
_FUSE_ROPE = contextvars.ContextVar("msa_fused_rope", default=False)
_DISPATCH = "_msa_rope_dispatch"  # on the dispatcher that replaced an HF module's apply_rotary_pos_emb
FUSED_NORM = "_msa_fused_norm"    # on each RMSNorm fuse_token_ops patched (memory.tile_token_layers skips them)
FUSED_MLP = "msa_fused_forward"   # on each MLP fuse_token_ops patched: its fused forward (memory._plain_mlp runs it)
# MLPs whose forward is down_proj(act_fn(gate_proj(x)) * up_proj(x)): the ones the SwiGLU kernel replaces
SWIGLU_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
MAX_NORM_WIDTH = 8192             # one row in registers; wider norms run HF's code


def _runs_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1")


@functools.lru_cache(maxsize=None)
def _programs(device: torch.device) -> int:
    """Programs of the norm's backward: a few per SM (each loops over its rows); 4 in the interpreter."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


# ----------------------------------------------------------------------------------------- RMSNorm
@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, n_cols, eps,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < n_cols)[None, :]
    offs = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    xhat = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)  # HF: rounded before the weight
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (w[None, :] * xhat).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _rms_norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, n_rows, n_cols,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr, WANT_DX: tl.constexpr, WANT_DW: tl.constexpr):
    """Program p takes the row tiles p, p + P, p + 2P, ...; its fp32 weight-gradient sum goes to row p
    of dw [P, n_cols], which the caller sums over P."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < n_cols
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * ROWS, n_rows, tl.num_programs(0) * ROWS):
        rows = tl.arange(0, ROWS).to(tl.int64) + start
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        xhat = x * rstd[:, None]
        if WANT_DX:  # (the weight read again each tile, from L1/L2: not held in registers across the loop)
            w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            dxhat = dy * w[None, :]
            c = tl.sum(dxhat * xhat, axis=1) / n_cols
            dx = (dxhat - xhat * c[:, None]) * rstd[:, None]
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if WANT_DW:
            dw += tl.sum(dy * xhat.to(x_ptr.dtype.element_ty).to(tl.float32), axis=0)
    if WANT_DW:
        tl.store(dw_ptr + pid.to(tl.int64) * n_cols + cols, dw, mask=col_ok)


def _norm_launch(n_cols: int, backward: bool = False) -> tuple[int, int, int]:
    """(BLOCK, ROWS, num_warps): whole rows, about 4096 elements a tile (2048 in the backward, which
    holds about twice the forward's values per element, and more warps for wide rows). Compiled for
    sm_90 the way scripts/kernel_resources.py does, with Triton 3.6, neither spills at any width up
    to 8192."""
    block = max(16, triton.next_power_of_2(n_cols))
    if backward:
        return block, max(1, 2048 // block), min(16, max(4, block // 256))
    return block, max(1, 4096 // block), 4 if block <= 2048 else (8 if block <= 4096 else 16)


class _RMSNorm(torch.autograd.Function):
    """``norm.weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over the last dimension."""

    @staticmethod
    def forward(ctx, x, weight, norm):
        shape, n_cols = x.shape, x.shape[-1]
        rows = x.reshape(-1, n_cols).contiguous()
        y = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rstd = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
        block, per_tile, warps = _norm_launch(n_cols)
        _rms_norm_fwd_kernel[(triton.cdiv(rows.shape[0], per_tile),)](
            rows, weight, y, rstd, rows.shape[0], n_cols, float(norm.variance_epsilon),
            ROWS=per_tile, BLOCK=block, num_warps=warps)
        ctx.norm = norm  # its weight, read again in the backward (under ZeRO-3 gathered again there)
        ctx.save_for_backward(rows, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        rows, rstd = ctx.saved_tensors
        weight = ctx.norm.weight
        want_dx, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n_rows, n_cols = rows.shape
        block, per_tile, warps = _norm_launch(n_cols, backward=True)
        programs = max(1, min(_programs(rows.device), triton.cdiv(n_rows, per_tile)))
        dx = torch.empty_like(rows) if want_dx else None
        dw = torch.empty(programs, n_cols, dtype=torch.float32, device=rows.device) if want_dw else None
        _rms_norm_bwd_kernel[(programs,)](
            dy.reshape(n_rows, n_cols).contiguous(), rows, weight, rstd,
            dx if want_dx else rows, dw if want_dw else rstd, n_rows, n_cols,
            ROWS=per_tile, BLOCK=block, WANT_DX=want_dx, WANT_DW=want_dw, num_warps=warps)
        return (dx.view(ctx.shape) if want_dx else None,
                dw.sum(0).to(weight.dtype) if want_dw else None, None)


def _fused_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if not _runs_triton(x) or x.numel() == 0:
        return type(self).forward(self, x)
    return _RMSNorm.apply(x, self.weight, self)


# -------------------------------------------------------------------------------------------- RoPE
@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, n_rows, T, H, sxb, sxt, sxh, scb, sct,
                 HALF: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, BACKWARD: tl.constexpr):
    """ROWS (token, head) rows: y = x * cos + rotate_half(x) * sin, i.e. with x = [x1, x2]
    y1 = x1 c1 - x2 s1 and y2 = x2 c2 + x1 s2; the backward applies the transposed map.
    x [B, T, H, 2 HALF] (last stride 1), cos/sin [B or 1, T, 2 HALF] (last stride 1), y contiguous."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    token, h = rows // H, rows % H
    b, t = token // T, token % T
    d = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (d < HALF)[None, :]
    c_at = (b * scb + t * sct)[:, None] + d[None, :]
    c1 = tl.load(cos_ptr + c_at, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + c_at + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + c_at, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + c_at + HALF, mask=mask, other=0.0).to(tl.float32)
    x_at = (b * sxb + t * sxt + h * sxh)[:, None] + d[None, :]
    x1 = tl.load(x_ptr + x_at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_at + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    y_at = rows[:, None] * (2 * HALF) + d[None, :]
    tl.store(y_ptr + y_at, y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + y_at + HALF, y2.to(y_ptr.dtype.element_ty), mask=mask)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """x [B, T, H, D] (any strides, the last made 1), cos/sin [B or 1, T, D] -> contiguous [B, T, H, D]."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    B, T, H, D = x.shape
    y = torch.empty((B, T, H, D), dtype=x.dtype, device=x.device)
    block_d = triton.next_power_of_2(D // 2)
    rows, per_tile = B * T * H, max(1, 2048 // block_d)
    _rope_kernel[(triton.cdiv(rows, per_tile),)](
        x, cos, sin, y, rows, T, H, x.stride(0), x.stride(1), x.stride(2), cos.stride(0) if cos.shape[0] > 1 else 0,
        cos.stride(1), HALF=D // 2, BLOCK_D=block_d, ROWS=per_tile, BACKWARD=backward, num_warps=4)
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):  # x [B, T, H, D]
        ctx.save_for_backward(cos, sin)
        return _rope(x, cos, sin, backward=False)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rope(dy, cos, sin, backward=True), None, None


def _fusable_rope(q, k, cos, sin, unsqueeze_dim) -> bool:
    if not _FUSE_ROPE.get() or unsqueeze_dim != 1:
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False  # HF's layout: q/k [B, H, T, D], cos/sin [B or 1, T, D]
    D = q.shape[-1]
    if D % 2 or k.shape[-1] != D or cos.shape[-1] != D or cos.shape[1] != q.shape[2] or k.shape[2] != q.shape[2]:
        return False
    if k.shape[0] != q.shape[0]:
        return False
    if cos.shape[0] not in (1, q.shape[0]) or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        return False
    if cos.requires_grad or sin.requires_grad or not (_runs_triton(q) and q.device == k.device == cos.device):
        return False
    return q.dtype == k.dtype == cos.dtype == sin.dtype  # (HF's output dtype is promoted; the kernel's is q's)


def rope_dispatcher(hf_apply):
    """What replaces an HF module's ``apply_rotary_pos_emb``: the kernel for calls made while a
    patched attention module runs (and shapes it covers), ``hf_apply`` otherwise.

    Since transformers 5.25 ``hf_apply`` is an nn.Module of the ``kernels`` library (a function
    wrapped by ``use_kernel_forward_from_hub``), and every attention module holds a private copy
    that pickles as ``type(<HF module>.apply_rotary_pos_emb)()``. The dispatcher is then an instance
    of a subclass of its class, so that this call still builds a working copy of HF's."""
    def apply_rotary_pos_emb(q, k, cos, sin, *args, unsqueeze_dim=1, **kwargs):
        if args or kwargs or not _fusable_rope(q, k, cos, sin, unsqueeze_dim):
            return hf_apply(q, k, cos, sin, *args, unsqueeze_dim=unsqueeze_dim, **kwargs)
        rotate = lambda x: _Rope.apply(x.transpose(1, 2), cos, sin).transpose(1, 2)  # noqa: E731
        return rotate(q), rotate(k)

    if isinstance(hf_apply, nn.Module):
        base = type(hf_apply)

        def forward(self, *a, **kw):
            return apply_rotary_pos_emb(*a, **kw)

        forward.__signature__ = inspect.signature(base.forward)  # what `kernels` validates layers by
        body = {"forward": forward, _DISPATCH: True, "__module__": base.__module__}
        return type(base.__name__, (base,), body)()
    apply_rotary_pos_emb = functools.wraps(hf_apply)(apply_rotary_pos_emb)
    setattr(apply_rotary_pos_emb, _DISPATCH, True)
    return apply_rotary_pos_emb


def _fused_rope_attention_forward(self: nn.Module, *args, **kwargs):
    token = _FUSE_ROPE.set(True)
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        _FUSE_ROPE.reset(token)


# ------------------------------------------------------------------------------------------ SwiGLU
@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, dy_ptr, y_ptr, du_ptr, n, BLOCK: tl.constexpr, BACKWARD: tl.constexpr):
    """Forward: y = silu(g) * u. Backward: dg = dy * u * s * (1 + g (1 - s)) with s = sigmoid(g),
    written over y_ptr, and du = dy * silu(g) over du_ptr. fp32 math, one rounding per output."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    if BACKWARD:
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, (dy * u * s * (1.0 + g * (1.0 - s))).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(du_ptr + offs, (dy * g * s).to(du_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(y_ptr + offs, (g * s * u).to(y_ptr.dtype.element_ty), mask=mask)


_SWIGLU_BLOCK = 2048


class _SwiGLU(torch.autograd.Function):
    """``silu(g) * u`` for g, u of one shape and dtype."""

    @staticmethod
    def forward(ctx, g, u):
        g, u = g.contiguous(), u.contiguous()
        y = torch.empty_like(g)
        grid = (triton.cdiv(g.numel(), _SWIGLU_BLOCK),)
        _swiglu_kernel[grid](g, u, g, y, y, g.numel(), BLOCK=_SWIGLU_BLOCK, BACKWARD=False, num_warps=4)
        ctx.save_for_backward(g, u)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        dg, du = torch.empty_like(g), torch.empty_like(u)
        grid = (triton.cdiv(g.numel(), _SWIGLU_BLOCK),)
        _swiglu_kernel[grid](g, u, dy.contiguous(), dg, du, g.numel(), BLOCK=_SWIGLU_BLOCK, BACKWARD=True, num_warps=4)
        return dg, du


def _fused_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    g, u = self.gate_proj(x), self.up_proj(x)
    if not _runs_triton(g) or g.numel() == 0 or g.dtype != u.dtype:
        return self.down_proj(self.act_fn(g) * u)
    return self.down_proj(_SwiGLU.apply(g, u))


def _is_linear(m) -> bool:
    """An nn.Linear, or one under a LoRA adapter (peft's layer keeps it as ``base_layer``): the fused
    MLP calls its projections as modules, so an adapter on them applies."""
    return isinstance(m, nn.Linear) or isinstance(getattr(m, "base_layer", None), nn.Linear)


def _is_swiglu_mlp(m: nn.Module) -> bool:
    return (type(m).__name__ in SWIGLU_MLPS and type(getattr(m, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
            and all(_is_linear(getattr(m, name, None)) for name in ("gate_proj", "up_proj", "down_proj")))


# ------------------------------------------------------------------------------------------- patch
def is_rms_norm(m: nn.Module) -> bool:
    """An HF RMSNorm (Llama's, Qwen2's, Qwen3's, ...): what the fused and the tiled norms replace."""
    return (type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon")
            and isinstance(getattr(m, "weight", None), torch.Tensor))


def fuse_token_ops(model: nn.Module, attention_modules) -> tuple[int, int, int]:
    """Run ``model``'s RMSNorms, its attention layers' RoPE and its SwiGLU MLPs through the kernels
    above, in place; returns (norms, attention modules whose RoPE is fused, MLPs).
    ``attention_modules``: the family's attention modules (their class's HF module holds the
    ``apply_rotary_pos_emb`` they call)."""
    attention = list(attention_modules)
    modules = {sys.modules[type(a).__module__] for a in attention}
    if not attention or not all(callable(getattr(mod, "apply_rotary_pos_emb", None)) for mod in modules):
        raise ValueError(f"parallel.fused_ops: {type(model).__name__} is not laid out as the HF Llama/Qwen models "
                         "this patches (attention modules whose HF module has an apply_rotary_pos_emb)")
    # (wider norms run HF's code, so they stay unmarked and parallel.tile_tokens still tiles them;
    # under ZeRO-3 a partitioned weight's own shape is empty, its full one is ds_shape)
    norms = [m for m in model.modules()
             if is_rms_norm(m) and getattr(m.weight, "ds_shape", m.weight.shape)[-1] <= MAX_NORM_WIDTH]
    for norm in norms:
        # (functools.partial, not a bound method: it pickles and deep-copies with the module)
        norm.forward = functools.partial(_fused_norm_forward, norm)
        setattr(norm, FUSED_NORM, True)
    mlps = [m for m in model.modules() if _is_swiglu_mlp(m)]
    for mlp in mlps:
        setattr(mlp, FUSED_MLP, functools.partial(_fused_mlp_forward, mlp))
        mlp.forward = getattr(mlp, FUSED_MLP)
    for mod in modules:
        if not getattr(mod.apply_rotary_pos_emb, _DISPATCH, False):
            mod.apply_rotary_pos_emb = rope_dispatcher(mod.apply_rotary_pos_emb)
    for attn in attention:
        attn.forward = functools.partial(_fused_rope_attention_forward, attn)
    return len(norms), len(attention), len(mlps)
