"""Activation memory for long sequences: what a decoder layer keeps for its backward.

At 1M tokens every ``T x hidden`` tensor of a Llama-3-8B layer is 8 GiB in bf16 and 16 GiB in fp32.
Under per-layer activation checkpointing a layer keeps its input between the forward and its
backward, and during its recompute and backward it holds all it saved at once. Counted with
saved-tensor hooks on one Llama-3-8B-shape layer (bf16, SDPA attention), in KiB per token: 197 in
all, of which the SwiGLU MLP 120 (its input and four ``T x intermediate`` tensors) and each of HF's
two RMSNorms 24 (its fp32 input and its bf16 normalised rows). With ``parallel.tile_tokens`` the MLP
and each norm keep 8 (their bf16 input) and the layer 53, the rest being attention's;
``parallel.offload_activations`` moves the layers' inputs to host memory.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import torch
import torch.nn as nn


# True while a checkpointed layer is being recomputed for its backward (set by `layer_checkpoint`).
_RECOMPUTING = contextvars.ContextVar("msa_train_recomputing", default=False)


def layer_checkpoint(function, *args, offload: bool = False, **kwargs):
    """Non-reentrant ``torch.utils.checkpoint`` of one decoder layer (its ``_gradient_checkpointing_func``)
    that marks the backward's recompute of the layer, so the tiled MLP can skip its forward there
    (``_tiled_mlp_forward``): the checkpoint runs ``function`` once in the forward and once more in the
    backward, for the tensors the layer saves and nothing else.

    ``offload=True`` (``parallel.offload_activations``): the checkpoint saves its inputs as autograd
    saved tensors before it runs the layer (under its own hooks, which keep nothing of the layer's
    insides), so an enclosing ``save_on_cpu`` moves exactly those inputs to pinned host memory, and the
    backward copies each back just before the layer is recomputed. (transformers 5.24 offers the
    same as ``activation_checkpointing_enable(offload=True)``; setting the layers' checkpoint function
    works with every version we support.)
    """
    from torch.utils.checkpoint import checkpoint

    calls = 0

    def run(*a, **k):
        nonlocal calls
        calls += 1
        token = _RECOMPUTING.set(calls > 1)
        try:
            return function(*a, **k)
        finally:
            _RECOMPUTING.reset(token)

    hooks = contextlib.nullcontext()
    if offload:
        if not any(isinstance(a, torch.Tensor) for a in args):  # what save_on_cpu would move: positional inputs only
            raise RuntimeError("parallel.offload_activations: the checkpointed layer got its hidden states as a "
                               "keyword argument, which the checkpoint does not save (nothing would be offloaded)")
        cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
        hooks = torch.autograd.graph.save_on_cpu(pin_memory=cuda)  # CPU tensors: packed as they are
    with hooks:
        return checkpoint(run, *args, use_reentrant=False, **kwargs)


def tile_token_layers(model: nn.Module, tile_tokens: int) -> tuple[int, int]:
    """Make every decoder MLP and every RMSNorm of ``model`` keep only its input for the backward,
    working on at most ``tile_tokens`` tokens at a time; returns (MLPs, norms) patched.

    * MLPs run through DeepSpeed's ``TiledMLP``: the tiles run without autograd in the forward and
      each is recomputed with it in the backward, so the ``T x intermediate`` activations exist one
      tile at a time.
    * RMSNorms run through :class:`_RecomputedNorm` (HF's norm, recomputed tile by tile).

    The number of tiles depends only on the sequence length, so every rank (data or sequence
    parallel) runs the same number and ZeRO-3's parameter gathers stay in step.
    """
    if tile_tokens < 1:
        raise ValueError(f"parallel.tile_tokens must be >= 1 (0 turns tiling off), got {tile_tokens}")
    layers = getattr(getattr(model, "model", model), "layers", None)
    with_mlp = [layer for layer in (layers or []) if hasattr(layer, "mlp")]
    mlps = [layer.mlp for layer in with_mlp]
    from msa_train.models.fused_ops import FUSED_NORM, is_rms_norm

    # (a fused norm keeps only its input already: parallel.fused_ops)
    norms = [m for m in model.modules() if is_rms_norm(m) and not getattr(m, FUSED_NORM, False)]
    if not mlps:
        raise ValueError(f"parallel.tile_tokens: {type(model).__name__} has no decoder layers with an `mlp`")
    for layer in with_mlp:
        layer.mlp.forward = functools.partial(_tiled_mlp_forward, layer.mlp)  # (pickles, unlike a bound method)
        layer.mlp.tile_tokens = tile_tokens
        layer.mlp.skip_in_recompute = type(layer).__name__ in MLP_LAST_LAYERS
    for norm in norms:
        norm.forward = functools.partial(_recomputed_norm_forward, norm)
        norm.tile_tokens = tile_tokens
    return len(mlps), len(norms)


def _tiles(x: torch.Tensor, tile_tokens: int) -> int:
    """Tiles of at most ``tile_tokens`` tokens for x [B, T, ...] (HF's layout), at least one."""
    tokens = x.shape[0] * x.shape[1] if x.dim() >= 3 else x.shape[0]
    return max(1, math.ceil(tokens / tile_tokens))


def _plain_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from msa_train.models.fused_ops import FUSED_MLP

    fused = getattr(mlp, FUSED_MLP, None)  # parallel.fused_ops: its SwiGLU kernel, tile by tile
    return fused(x) if fused is not None else type(mlp).forward(mlp, x)


# Decoder layers whose MLP output only meets the residual add (nothing after it saves a tensor), so a
# recompute may leave it unset; a layer with, e.g., a norm after its MLP (Gemma 2) is not one of them.
MLP_LAST_LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"})


class _SavedInputOnly(torch.autograd.Function):
    """What TiledMLP saves (its input, and nothing else) without its forward: its stand-in in a
    checkpoint's recompute, where only the saved tensors are kept (the recompute's graph is dropped)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.empty_like(x)  # never read: see _tiled_mlp_forward

    @staticmethod
    def backward(ctx, dy):
        raise RuntimeError("internal: the recompute's stand-in for the tiled MLP was differentiated")


def _tiled_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    tiles = min(x.shape[-2], _tiles(x, self.tile_tokens))  # TiledMLP splits dim -2 (T), B rows per tile
    if tiles <= 1 or not torch.is_grad_enabled():
        return _plain_mlp(self, x)
    # In a checkpoint's recompute the layer runs only to save its tensors again; TiledMLP saves its
    # input and nothing else, and its backward recomputes each tile itself. So its output there is never
    # read (the layer's output is dropped, and the residual add after the MLP saves nothing): the same
    # save without the MLP's forward: one MLP forward less per layer and step (4 layers of Llama-3-8B
    # shape at 256K: backward 6.59 -> 5.98 s, benchmarks/results/phases/breakdown.md).
    if self.skip_in_recompute and _RECOMPUTING.get():
        return _SavedInputOnly.apply(x)
    return TiledMLP.apply(_plain_mlp, self, x, tiles, list(self.parameters()))


def _recomputed_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled():
        return type(self).forward(self, x)
    return _RecomputedNorm.apply(x, self.weight, self)


class _RecomputedNorm(torch.autograd.Function):
    """HF's RMSNorm (the module's own forward) keeping only its input for the backward.

    Written here because the library versions of this (liger-kernel's fused RMSNorm) are Triton
    kernels of their own, which the GPU image lacks and the CPU tests could only interpret: this
    reuses HF's code as it is, so the forward is HF's bit for bit, and the backward recomputes it
    with autograd in token tiles, so its fp32 temporaries exist one tile at a time. The weight's
    gradient is summed over the tiles in fp32.
    """

    @staticmethod
    def forward(ctx, x, weight, norm):
        ctx.norm = norm
        ctx.save_for_backward(x)
        return type(norm).forward(norm, x)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        norm = ctx.norm
        weight = norm.weight
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        width = x.shape[-1]
        tiles = _tiles(x, norm.tile_tokens)
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if want_x else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        dx_tiles = dx.view(-1, width).chunk(tiles) if want_x else [None] * tiles
        for xs, dys, dxs in zip(x.reshape(-1, width).chunk(tiles), dy.reshape(-1, width).chunk(tiles), dx_tiles):
            with torch.enable_grad():
                leaf = xs.detach().requires_grad_(want_x)
                inputs = [t for t, want in ((leaf, want_x), (weight, want_w)) if want]
                grads = iter(torch.autograd.grad(type(norm).forward(norm, leaf), inputs, dys))
            if want_x:
                dxs.copy_(next(grads))
            if want_w:
                dw += next(grads)
        return dx, dw.to(weight.dtype) if want_w else None, None


def out_of_memory_hint(cfg) -> str:
    """What a run that ran out of device memory can turn on, from its config (``msa_train.config``'s
    typed config): the memory options it does not use yet, then more GPUs or shorter sequences.
    The CLI appends it to the out-of-memory error."""
    p, steps = cfg.parallel, []
    if not p.activation_checkpointing:
        steps.append("parallel.activation_checkpointing=true (each layer keeps only its input)")
    if not p.tile_tokens:
        steps.append("parallel.tile_tokens=32768 (MLPs and norms keep only their inputs)")
    if not p.offload_activations:
        steps.append("parallel.offload_activations=true (the layers' inputs in host memory; needs checkpointing)")
    if not p.offload_optimizer:  # needs ZeRO >= 1
        steps.append(("parallel=zero2 " if p.zero_stage == 0 else "")
                     + "parallel.offload_optimizer=true parallel.optimizer=deepspeed "
                       "(AdamW state in host memory, stepped by cpu_adam)")
    if p.zero_stage == 3 and not p.offload_params:
        steps.append("parallel.offload_params=true (parameters in host memory)")
    if cfg.train.loss_impl == "fused":
        steps.append("train.loss_impl=recompute (the loss keeps no vocab x hidden weight gradient from its "
                     "forward to the backward; slower)")
    steps.append("more GPUs with parallel.sp_degree (each rank holds seq_len / sp_degree tokens per layer), "
                 f"or a shorter train.seq_len (now {cfg.train.seq_len})")
    return (f"out of device memory at train.seq_len={cfg.train.seq_len}. Memory options this run does not use yet:\n  - "
            + "\n  - ".join(steps) + "\n(docs/trainer.md, 'Memory for long sequences')")
