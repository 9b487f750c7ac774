"""Kernel tests: every torch.empty / empty_like of a floating dtype is filled with NaN, so an
output element a kernel forgets to write shows up as NaN (assert_close fails on NaN)."""
import contextlib

import pytest
import torch

_empty, _empty_like = torch.empty, torch.empty_like


def _poison(x):
    # no_grad: a caller may ask for requires_grad=True (seen on CUDA in the compressed-attention tests)
    if x.is_floating_point():
        with torch.no_grad():
            x.fill_(float("nan"))
    return x


def _nan_empty(*args, **kwargs):
    return _poison(_empty(*args, **kwargs))


def _nan_empty_like(*args, **kwargs):
    return _poison(_empty_like(*args, **kwargs))


@pytest.fixture(autouse=True)
def _poison_empty(monkeypatch):
    monkeypatch.setattr(torch, "empty", _nan_empty)
    monkeypatch.setattr(torch, "empty_like", _nan_empty_like)
    yield


@pytest.fixture
def small_range_tiles():
    """16x16 range-attention tiles, so short inputs run all three loop parts (masked edges,
    unmasked interior) of the window and compressed-attention kernels."""
    from flash_msa import tuning
    with tuning.override(range_attention=dict(fwd=(16, 16, {}), dq=(16, 16, {}), dkdv=(16, 16, {}))):
        yield


@pytest.fixture
def launch():
    """``launch(op, **settings)``: the rest of the test runs with these launch settings of ``op``
    (flash_msa.tuning.override); calls add up, a later value of a setting winning."""
    from flash_msa import tuning
    stack, acc = contextlib.ExitStack(), {}

    def set_(op, **settings):
        acc.setdefault(op, {}).update(settings)
        stack.close()
        stack.enter_context(tuning.override(**acc))
    yield set_
    stack.close()
