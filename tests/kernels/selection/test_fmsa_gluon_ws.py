"""fmsa's dk/dv kernel in Gluon (selection/fmsa_gluon_ws.py), on Hopper GPUs only: the gradients
against the dense reference and against the Triton kernel, over group sizes, head dims, varlen,
partitions (one and all KV heads, several chunks), keys split into segments, and fp16."""
import pytest
import torch

from flash_msa.selection import fmsa, fmsa_gluon_ws
from tests.helpers import assert_close
from tests.kernels.selection._cases import assert_matches_reference, make_case, run

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and fmsa_gluon_ws.AVAILABLE),
    reason="the Gluon dk/dv kernel runs on Hopper GPUs only (the CPU tests run the Triton kernel)")

# (T or cu_seqlens, HK, G, D, S, block_size=64: the block size the Gluon kernel takes)
SHAPES = {
    "g1-t700-d64": (700, 2, 1, 64, 4, 64),
    "g3-varlen-short": ([0, 5, 21, 22, 150, 157, 600], 1, 3, 128, 4, 64),
    "g4-t1500": (1500, 2, 4, 128, 8, 64),
    "g5-t900-d64": (900, 2, 5, 64, 6, 64),
    "g7-t700": (700, 1, 7, 128, 5, 64),
    "g16-t400": (400, 1, 16, 128, 5, 64),
}


class _Count:
    """Counts launches of a kernel, passing them on."""

    def __init__(self, kernel):
        self.kernel, self.n = kernel, 0

    def __getitem__(self, grid):
        self.n += 1
        return self.kernel[grid]


def _case(shape, seed=0):
    T, HK, G, D, S, bs = shape
    cu = None
    if isinstance(T, list):
        cu, T = T, T[-1]
    return make_case(T, HK, G, D, S, bs, "cuda", cu_seqlens=cu, seed=seed)


def _check(c, monkeypatch, **kwargs):
    spy = _Count(fmsa_gluon_ws.fmsa_bwd_dkdv_gluon_ws_kernel)
    monkeypatch.setattr(fmsa_gluon_ws, "fmsa_bwd_dkdv_gluon_ws_kernel", spy)
    monkeypatch.setattr(fmsa, "BWD_GLUON_WS", True)
    outs = assert_matches_reference("fmsa", c, "cuda", **kwargs)
    assert spy.n > 0, "the Gluon kernel did not run"
    monkeypatch.setattr(fmsa, "BWD_GLUON_WS", False)
    for name, x, y in zip(("dq", "dk", "dv"), outs[1:], run("fmsa", c, **kwargs)[1:]):
        assert_close(f"gluon {name} vs triton", x.float(), y.float(), tol=1e-2)


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_gluon_dkdv_matches_reference_and_triton(shape, monkeypatch):
    _check(_case(shape), monkeypatch)


@pytest.mark.parametrize("chunk, heads", [(256, 1), (512, None)])
def test_gluon_dkdv_partitions(chunk, heads, monkeypatch):
    _check(_case((1100, 2, 4, 128, 6, 64), seed=1), monkeypatch, chunk_size=chunk, heads=heads)


def test_gluon_dkdv_split_keys(monkeypatch):
    # segments of 2 tiles of 128 rows: block 0 (every query) is split and reduced
    monkeypatch.setattr(fmsa, "SEG_TILES", 2)
    _check(_case((1300, 1, 4, 128, 6, 64), seed=3), monkeypatch)


def test_gluon_dkdv_fp16(monkeypatch):
    c = _case((800, 2, 5, 128, 6, 64), seed=2)
    c.q, c.k, c.v = (x.detach().half().requires_grad_() for x in (c.q, c.k, c.v))
    c.do = c.do.half()
    monkeypatch.setattr(fmsa, "BWD_GLUON_WS", True)
    g = run("fmsa", c)
    monkeypatch.setattr(fmsa, "BWD_GLUON_WS", False)
    t = run("fmsa", c)
    for name, x, y in zip(("dq", "dk", "dv"), g[1:], t[1:]):
        assert x.dtype == torch.float16
        assert_close(f"gluon fp16 {name} vs triton", x.float(), y.float(), tol=1e-2)
