"""Launch settings of the Triton kernels (and one of the PyTorch reference), and the scoped
override that benchmarks and tests use.

Every op keeps one table of its tuned settings beside its kernels, with the measurements that
chose them (H200, docs/nsa_kernels.md and docs/selected_attention.md):

| op | table | settings |
|---|---|---|
| ``"fmsa"`` | ``selection/fmsa.py`` ``LAUNCH`` | tiles, warps, stages, register caps, TMA writes, segments, partial budget |
| ``"range_attention"`` | ``window/window.py`` ``_tiles`` | ``fwd`` / ``dq`` / ``dkdv`` tiles (BM, BN, options), ``desc`` |
| ``"compress"`` | ``compression/compress.py`` ``_tiles`` | ``fwd`` / ``prep`` / ``dx`` / ``dw`` tiles, ``dw_split_rows``, ``dw_max_splits`` |
| ``"topk"`` | ``compression/topk.py`` ``_launch`` | ``BT``, ``opts`` and the sort-network flags |
| ``"dense_cmp"`` | ``compression/dense_cmp.py`` ``SETTINGS`` | ``backend``, ``min_groups``, ``offsets_per_call``, ``chunks`` |
| ``"fused"`` | ``fused.py`` ``SETTINGS`` | ``local_in_window`` |
| ``"reference"`` | ``selection/naive.py`` ``SETTINGS`` | ``selected_dense_span`` (measured on a CPU) |

The kernels read their settings at every launch through :func:`settings`, so a benchmark times a
variant without changing any module state::

    with flash_msa.tuning.override(fmsa=dict(fwd_warps=8, fwd_tma=False)):
        o = flash_msa.selected_attention(q, k, v, idx, block_size=64, impl="fmsa")

An override replaces the named entries of the op's table (for the tile ops, the whole entry of a
kernel, e.g. ``range_attention=dict(fwd=(64, 64, dict(num_warps=4)))``) inside the ``with`` block,
in this thread or asyncio task only; nested overrides merge, the inner one winning. Unknown ops or
settings raise ValueError. Outside an override the tuned tables apply unchanged.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any, Iterator, Mapping

# op -> the names of its settings; each op module registers its table when it is imported
_NAMES: dict[str, frozenset] = {}
_OVERRIDE: ContextVar[Mapping[str, Mapping[str, Any]]] = ContextVar("flash_msa_tuning", default=MappingProxyType({}))


def register(op: str, names) -> None:
    """Declares op ``op`` and the names of its settings (called once by the module that owns the table)."""
    _NAMES[op] = frozenset(names)


def settings(op: str, defaults: Mapping[str, Any]) -> Mapping[str, Any]:
    """``defaults`` (the op's tuned table) with the active override's entries for ``op`` applied."""
    over = _OVERRIDE.get().get(op)
    return defaults if not over else {**defaults, **over}


def ops() -> dict[str, frozenset]:
    """The registered ops and their setting names."""
    _import_tables()
    return dict(_NAMES)


def _import_tables() -> None:
    # the modules that register the tables (no module-level import: they import this module)
    import flash_msa.compression.compress  # noqa: F401
    import flash_msa.compression.dense_cmp  # noqa: F401
    import flash_msa.compression.topk  # noqa: F401
    import flash_msa.fused  # noqa: F401
    import flash_msa.selection.fmsa  # noqa: F401
    import flash_msa.selection.naive  # noqa: F401
    import flash_msa.window.window  # noqa: F401


@contextmanager
def override(**ops_settings: Mapping[str, Any]) -> Iterator[None]:
    """Replace launch settings inside a ``with`` block: ``override(op=dict(name=value, ...), ...)``.

    Raises:
        ValueError: an op or a setting name that does not exist (the message lists the valid ones).
    """
    known = ops()
    for op, values in ops_settings.items():
        if op not in known:
            raise ValueError(f"tuning.override: unknown op {op!r}; ops: {', '.join(sorted(known))}")
        if not isinstance(values, Mapping):
            raise TypeError(f"tuning.override: {op}= must be a dict of settings, got {type(values).__name__}")
        bad = sorted(set(values) - known[op])
        if bad:
            raise ValueError(f"tuning.override: {op} has no setting {', '.join(map(repr, bad))}; "
                             f"settings: {', '.join(sorted(known[op]))}")
    outer = _OVERRIDE.get()
    merged = {op: {**outer.get(op, {}), **ops_settings.get(op, {})} for op in {*outer, *ops_settings}}
    token = _OVERRIDE.set(MappingProxyType(merged))
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


__all__ = ["override", "ops", "settings"]
