"""Index metadata computed once per batch and shared by every layer.

Each layer of a training step gets the same ``cu_seqlens`` tensor, so everything derived
from it alone (sequence bounds, compressed rows, key ranges, tile tables) is the same in all
layers, in the forward and in the recomputed forward of activation checkpointing.
:func:`per_batch` computes such a function once and returns the cached value while its
tensor arguments are the very same objects, alive and unmodified (their ``_version``), and
its other arguments are equal. Like autograd's own checks on saved tensors, it sees the
in-place writes that bump ``_version``; writes that bypass it (through ``.data``, a NumPy or
DLPack view) are not seen, so index tensors must not be rewritten that way. Cached values are
shared: callers treat them as read-only. Inference tensors (``torch.inference_mode``) carry no
version counter, so with them nothing is cached. At most 16 values are kept (O(T) index
tensors each), the oldest dropped first.

On CUDA two more rules, as for ``flash_msa.utils.varlen.default_cu_seqlens``:
- during CUDA graph capture nothing is read from or written to the cache. A graph replays only
  the kernels it captured, so a value found in the cache at capture time would be baked into the
  graph and never recomputed when the captured tensors are refilled in place before a replay (a
  silent wrong answer); and a value computed during capture holds nothing until a replay.
- values are cached per CUDA stream: the caching allocator ties a tensor's memory to the stream
  it was made on, so a value made on stream A and dropped from the cache while work queued on
  stream B still reads it could be handed out again on A too early.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch

_CACHE: list = []  # [(fn, static args, weakrefs to the tensor args, their _versions, value)], newest last
_CACHE_SIZE = 16


def cuda_cache_scope(device: torch.device) -> tuple[bool, Optional[int]]:
    """The CUDA rules of the caches of flash_msa (this module's and ``default_cu_seqlens``):
    (whether a value may be cached now: not during CUDA graph capture; the key part that keeps
    one value per CUDA stream, None on other devices). See the module docstring."""
    if device.type != "cuda":
        return True, None
    return not torch.cuda.is_current_stream_capturing(), torch.cuda.current_stream(device).cuda_stream


def per_batch(fn: Callable[..., Any], *args) -> Any:
    """``fn(*args)``, reused while the tensors among ``args`` are unchanged (see module docstring)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if any(t.is_inference() for t in tensors):  # no version counter to tell a stale value
        return fn(*args)
    statics = tuple(a for a in args if not isinstance(a, torch.Tensor))
    cuda = next((t.device for t in tensors if t.is_cuda), None)
    if cuda is not None:
        cacheable, stream = cuda_cache_scope(cuda)
        if not cacheable:
            return fn(*args)
        statics += (stream,)
    for f, st, refs, versions, value in reversed(_CACHE):
        if (f is fn and st == statics and len(refs) == len(tensors)
                and all(r() is t and v == t._version for r, v, t in zip(refs, versions, tensors))):
            return value
    value = fn(*args)
    _CACHE.append((fn, statics, [weakref.ref(t) for t in tensors], [t._version for t in tensors], value))
    del _CACHE[:-_CACHE_SIZE]
    return value
