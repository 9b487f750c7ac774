"""msa_train's attention backends, registered with transformers' attention interface.

The HF attention module computes q/k/v with its own projections, q/k norms and RoPE, then calls
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, **kwargs)``.
We register two names:

* ``msa_full``: dense causal attention that never crosses packed documents and never builds a
  [T, T] mask. CUDA: SDPA ``is_causal`` with the cuDNN backend first when a row holds one document;
  ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 varlen, torch >= 2.10) for packed
  bf16/fp16 rows (:func:`dense_kernel_name` routes, and names the kernel for the benchmark).
  CPU (and the rare CUDA fp32 case): SDPA ``is_causal`` per document, a loop over documents that
  is only the fallback path.
* ``msa_nsa``: ``flash_msa.NativeSparseAttention`` stored on the attention module as ``.nsa``;
  with a KV cache (``generate()``), the new queries against the cached keys through its ``decode``.

Gates need the layer's hidden states, which the interface call does not receive. A forward
pre-hook on each attention module (:func:`stash_hidden_states`) stores them on the module for
the duration of its forward; the NSA backend pops them. Activation checkpointing re-runs the
module forward, so the hook runs again during recomputation.

Packing metadata travels through the HF ``**kwargs`` that reach the attention call:
``cu_seq_lens_q`` (int32 [N+1] on the model's device, FlashAttention convention) and
``max_length_q`` (Python int).
"""
from __future__ import annotations

import inspect
import weakref
from typing import Optional

import torch
import torch.nn.functional as F

FULL = "msa_full"
NSA = "msa_nsa"
DISTILL = "msa_distill"  # model.nsa_init=distill: dense output, NSA fitted to it (msa_train/models/distill.py)
_HIDDEN = "_msa_hidden_states"
_CACHE_LAYER = "_msa_cache_layer"  # the HF cache layer a decoding NSA module extends, for its forward only
_DECODE_STATE = "_msa_decode_state"  # on that cache layer: a _DecodeState
# on each patched attention module: its msa_train.parallel.sequence.SequenceParallel (None: off);
# defined here, where it is read, so that models never import parallel (parallel.sequence sets it)
SP_ATTR = "msa_sequence_parallel"

try:  # torch >= 2.10; its keyword arguments changed between releases, so probe them
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
    _VARLEN_PARAMS = set(inspect.signature(_varlen_attn).parameters)
except ImportError:  # older torch: the SDPA paths below serve
    _varlen_attn, _VARLEN_PARAMS = None, set()
_VARLEN_GQA = "enable_gqa" in _VARLEN_PARAMS
# torch 2.10 spells causal `is_causal=True`; later releases `window_size=(-1, 0)`.
_VARLEN_CAUSAL = {"window_size": (-1, 0)} if "window_size" in _VARLEN_PARAMS else {"is_causal": True}


def stash_hidden_states(module, args, kwargs):
    """Forward pre-hook: keep the attention input [B, T, hidden] for the NSA gates, and check the
    KV cache the layer is about to extend (:func:`check_kv_cache`)."""
    sparse = getattr(getattr(module, "config", None), "_attn_implementation", None) in (NSA, DISTILL)
    # only the NSA backend takes (and drops) them: under full attention a stashed input would stay
    # on every layer's module, T x hidden each, after the forward
    setattr(module, _HIDDEN, kwargs.get("hidden_states", args[0] if args else None) if sparse else None)
    check_kv_cache(module, kwargs)


def check_kv_cache(module, kwargs) -> None:
    """Both backends decode against the keys the cache hands them as the whole sequence so far, with
    no mask (none is registered). That holds for HF's DynamicCache, generate()'s default. A static
    cache hands over its whole zero-padded buffer and a sliding-window cache only the last keys, so
    either would give wrong tokens without an error; they are refused. On a model whose config has
    sliding-window layers, NSA replaced those layers, so before the prefill fills the layer's
    sliding-window cache it is swapped for a DynamicLayer that keeps every key (transformers >= 5,
    whose caches are lists of layers)."""
    if hasattr(module, "nsa"):
        setattr(module, _CACHE_LAYER, None)
    cache = kwargs.get("cache", kwargs.get("past_key_values", kwargs.get("past_key_value")))
    if cache is None:
        return
    layers, idx = getattr(cache, "layers", None), getattr(module, "layer_idx", None)
    if layers is None or idx is None or idx >= len(layers):
        layer = None  # transformers 4.5x, or a cache that creates its (dynamic) layers on first use
    else:
        layer = layers[idx]
        if (hasattr(module, "nsa") and getattr(layer, "is_sliding", False) and not layer.is_compileable
                and not getattr(layer, "is_initialized", True)):
            from transformers.cache_utils import DynamicLayer
            layer = layers[idx] = DynamicLayer()
    if getattr(layer if layer is not None else cache, "is_compileable", False) or getattr(layer, "is_sliding", False):
        raise NotImplementedError(
            f"msa_train's attention backends decode against every cached key with no mask, so they need a KV cache "
            f"that keeps all keys, as HF's DynamicCache (generate()'s default) does; got "
            f"{type(layer if layer is not None else cache).__name__}, which hands over a static buffer or only the "
            f"last keys: generate without cache_implementation, or pass past_key_values=DynamicCache()")
    if layer is not None and hasattr(module, "nsa"):
        state = getattr(layer, _DECODE_STATE, None)
        if state is not None and state.keys() is not getattr(layer, "keys", None):
            # the layer's keys were replaced otherwise than by the last decode step's append (beam
            # search reordered them, assisted decoding cropped them, ...): its compressed rows are stale
            setattr(layer, _DECODE_STATE, None)
        setattr(module, _CACHE_LAYER, layer)


class _DecodeState:
    """NSA decoding's compressed keys and values (:class:`flash_msa.decode.DecodeCache`), kept on an HF
    cache layer with a weak reference to the keys tensor they were last extended for; the layer's
    appends replace that tensor, and so do its crops and reorders, which :func:`check_kv_cache` tells
    apart by that tensor still being the layer's keys at the next step."""

    def __init__(self, keys: torch.Tensor, cache):
        self.keys, self.cache = weakref.ref(keys), cache

    def __deepcopy__(self, memo):  # a copied KV cache (e.g. a reused prompt cache) compresses its keys afresh
        return None

    def __reduce__(self):
        return type(None), ()


def _repeat_kv(x: torch.Tensor, group: int, dim: int) -> torch.Tensor:
    return x if group == 1 else x.repeat_interleave(group, dim=dim)


def _sdpa_causal(q, k, v, scale):
    """q [B, HQ, Tq, D], k/v [B, HK, Tk, D] -> [B, HQ, Tq, D], causal within the whole row; with
    Tq < Tk (decoding with a KV cache) the queries are the last Tq positions."""
    group = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, group, 1), _repeat_kv(v, group, 1)
    if q.shape[2] != k.shape[2]:
        from torch.nn.attention.bias import causal_lower_right
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
                                              scale=scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def full_attention_forward(module, query, key, value, attention_mask=None, scaling: Optional[float] = None,
                           dropout: float = 0.0, cu_seq_lens_q: Optional[torch.Tensor] = None,
                           max_length_q: Optional[int] = None, **kwargs):
    """Dense causal attention restricted to each packed document.

    Args:
        query: [B, HQ, T, D]; key, value: [B, HK, T, D] (HF layout, after norms and RoPE).
        attention_mask: ignored (no mask function is registered, HF passes None).
        cu_seq_lens_q: optional int32 [N+1] document offsets (B == 1); None = one document per row.
        max_length_q: longest document (int), needed by the varlen kernel.

    With sequence parallelism (the module's ``msa_sequence_parallel``, msa_train/parallel/sequence.py)
    the inputs hold the rank's T tokens and ``cu_seq_lens_q`` the whole sequence: q/k/v are exchanged
    to all tokens of the rank's heads (its KV heads replicated when there are fewer than ranks),
    and the output back to its tokens.

    Returns:
        ([B, T, HQ, D], None)
    """
    sp = getattr(module, SP_ATTR, None)
    if sp is None or sp.size == 1:
        return _full_attention(query, key, value, scaling, cu_seq_lens_q, max_length_q), None
    query = sp.to_heads(query, seq_dim=2, head_dim=1)
    key, value = (sp.kv_to_heads(x, seq_dim=2, head_dim=1) for x in (key, value))
    out = _full_attention(query, key, value, scaling, cu_seq_lens_q, max_length_q)
    return sp.to_sequence(out, seq_dim=1, head_dim=2), None


# Dense kernels behind attention=full, fastest first on an H200 (DESIGN.md's table: cuDNN SDPA
# 59 / 169 ms forward / backward at 64K against 104 / 274 for SDPA's flash backend).
SDPA_CUDNN = "sdpa_cudnn"            # one document per row: SDPA is_causal, cuDNN first
VARLEN_FLASH = "varlen_flash2"       # packed rows: torch's varlen_attn (FlashAttention-2 varlen)
SDPA_PER_DOCUMENT = "sdpa_per_document"  # packed rows without a varlen kernel (CPU, fp32): one SDPA each
SDPA = "sdpa"                        # one document per row, off CUDA: SDPA's own choice (math/flash CPU)
# SDPA backends in the order tried for one document: cuDNN, then flash, then the rest
_SDPA_ORDER = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def dense_kernel_name(is_cuda: bool, dtype: torch.dtype, num_docs: int, varlen_available: bool = True) -> str:
    """The dense kernel ``attention=full`` runs for a row of ``num_docs`` packed documents (the length
    of ``cu_seqlens`` minus one: a Python int the data loader knows, so routing needs no host sync).

    One document: SDPA ``is_causal`` with cuDNN first (:data:`SDPA_CUDNN`) on CUDA, SDPA's own choice
    elsewhere. Packed: FlashAttention-2 varlen through torch (:data:`VARLEN_FLASH`) on CUDA in bf16/fp16,
    else one SDPA per document. The benchmark records this name for every point."""
    half = dtype in (torch.float16, torch.bfloat16)
    if num_docs <= 1:
        return SDPA_CUDNN if is_cuda and half else SDPA
    if is_cuda and half and varlen_available:
        return VARLEN_FLASH
    return SDPA_PER_DOCUMENT


def _sdpa_backends():
    from torch.nn.attention import SDPBackend

    return [getattr(SDPBackend, name) for name in _SDPA_ORDER if hasattr(SDPBackend, name)]


def _full_attention(query, key, value, scaling, cu_seq_lens_q, max_length_q) -> torch.Tensor:
    """query [B, HQ, T, D], key/value [B, HK, T, D] -> [B, T, HQ, D] (see full_attention_forward)."""
    B, HQ, T, D = query.shape
    num_docs = 1 if cu_seq_lens_q is None else cu_seq_lens_q.numel() - 1  # shape only: no host sync
    if T != key.shape[2] and num_docs > 1:
        raise NotImplementedError("msa_full: a KV cache with packed documents (cu_seqlens) is not supported")
    kernel = dense_kernel_name(query.is_cuda, query.dtype, num_docs, _varlen_attn is not None)
    if kernel == SDPA_CUDNN:
        from torch.nn.attention import sdpa_kernel

        # cuDNN first; SDPA falls back down the list where cuDNN refuses a shape (head dim, a KV cache)
        with sdpa_kernel(_sdpa_backends(), set_priority=True):
            out = _sdpa_causal(query, key, value, scaling)
    elif kernel == SDPA:
        out = _sdpa_causal(query, key, value, scaling)
    elif kernel == VARLEN_FLASH:
        return _varlen_flash(query, key, value, scaling, cu_seq_lens_q, max_length_q)
    else:
        # one SDPA per document: the CPU path, whose offsets are host memory, so tolist() is no sync
        bounds = cu_seq_lens_q.tolist()
        parts = [_sdpa_causal(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], scaling)
                 for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
        out = torch.cat(parts, dim=2)
    return out.transpose(1, 2)


def _varlen_flash(query, key, value, scaling, cu_seq_lens_q, max_length_q) -> torch.Tensor:
    """torch's varlen_attn over the packed row: [1, HQ, T, D] x [1, HK, T, D] -> [1, T, HQ, D]."""
    HQ, T, D = query.shape[1:]
    q = query[0].transpose(0, 1).contiguous()  # [T, HQ, D]
    k, v = key[0].transpose(0, 1).contiguous(), value[0].transpose(0, 1).contiguous()
    group = HQ // k.shape[1]
    extra = dict(_VARLEN_CAUSAL)
    if "scale" in _VARLEN_PARAMS:
        extra["scale"] = scaling
    elif scaling is not None and abs(scaling - D ** -0.5) > 1e-12:
        raise NotImplementedError("this torch's varlen_attn has no scale argument; the model needs "
                                  f"scale {scaling}, not 1/sqrt(D)")
    if _VARLEN_GQA:
        extra["enable_gqa"] = True
    else:
        k, v = _repeat_kv(k, group, 1), _repeat_kv(v, group, 1)
    max_len = int(max_length_q) if max_length_q is not None else T
    o = _varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_len, max_len, **extra)
    return o.unsqueeze(0)


def nsa_attention_forward(module, query, key, value, attention_mask=None, scaling: Optional[float] = None,
                          dropout: float = 0.0, cu_seq_lens_q: Optional[torch.Tensor] = None, **kwargs):
    """Native Sparse Attention through the module's ``.nsa`` (flash_msa.NativeSparseAttention).

    Args:
        query: [B, HQ, T, D]; key, value: [B, HK, T, D].
        cu_seq_lens_q: optional int32 [N+1] (B == 1).

    Returns:
        ([B, T, HQ, D], None)
    """
    hidden = getattr(module, _HIDDEN, None)
    if hidden is None:
        raise RuntimeError("msa_nsa attention called without hidden states: was the module patched by patch_model?")
    setattr(module, _HIDDEN, None)  # drop the reference: the autograd graph keeps what it needs
    layer = getattr(module, _CACHE_LAYER, None)
    setattr(module, _CACHE_LAYER, None)
    nsa = module.nsa
    if query.shape[2] != key.shape[2]:
        # decoding with a KV cache: the queries are the last positions of the cached keys
        # (flash_msa/decode/: three Triton launches on CUDA); the prefill before it ran the whole op
        if cu_seq_lens_q is not None and cu_seq_lens_q.numel() > 2:
            raise NotImplementedError("msa_nsa: a KV cache with packed documents (cu_seqlens) is not supported")
        if getattr(module, SP_ATTR, None) is not None:
            raise NotImplementedError("msa_nsa: KV-cache decoding with sequence parallelism is not supported")
        from flash_msa.decode import DecodeCache

        state = getattr(layer, _DECODE_STATE, None) if layer is not None else None
        rows = state.cache if state is not None else DecodeCache()
        o = nsa.decode(hidden, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale=scaling,
                       cache=rows)
        if layer is not None:  # transformers >= 5: keep the compressed rows for the next step
            setattr(layer, _DECODE_STATE, _DecodeState(key, rows))
        return o, None
    select_impl(nsa, query)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # [B, T, H, D]
    # with sequence parallelism the module exchanges q/k/v and its gates itself (NativeSparseAttention.forward)
    o = nsa(hidden, q, k, v, cu_seqlens=cu_seq_lens_q, scale=scaling,
            sequence_parallel=getattr(module, SP_ATTR, None))
    return o, None


def select_impl(nsa, query: torch.Tensor) -> None:
    """The one place the trainer picks the NSA module's kernels for where its tensors are: the
    configured ``attention`` (``requested_impl``) on CUDA; anywhere else the PyTorch reference, which
    computes the same function (flash_msa refuses a named kernel on a CPU tensor)."""
    nsa.impl = nsa.requested_impl if query.is_cuda else "reference"


def register_attention_backends() -> None:
    """Register ``msa_full`` and ``msa_nsa`` with transformers (idempotent).

    No mask function is registered for them, so HF's mask builder returns None for these
    backends (transformers >= 4.53) and no [T, T] mask is ever built.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(FULL, full_attention_forward)
    AttentionInterface.register(NSA, nsa_attention_forward)
