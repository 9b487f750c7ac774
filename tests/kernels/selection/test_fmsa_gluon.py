"""fmsa's forward kernel in Gluon (selection/fmsa_gluon.py), on Hopper GPUs only: against the
dense reference (forward and the gradients of the backward that follows it) and against the
Triton kernel, over group sizes, block sizes, head dims, varlen and partitions."""
import pytest
import torch

from flash_msa.selection import fmsa, fmsa_gluon
from tests.helpers import assert_close
from tests.kernels.selection._cases import assert_matches_reference, make_case, run

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and fmsa_gluon.AVAILABLE),
    reason="the Gluon forward runs on Hopper GPUs only (the CPU tests run the Triton kernel)")

# (T or cu_seqlens, HK, G, D, S, block_size)
SHAPES = {
    "g1-bs16-t300-d64": (300, 2, 1, 64, 3, 16),
    "g3-bs32-varlen-short": ([0, 5, 21, 22, 150, 157, 400], 1, 3, 128, 4, 32),
    "g4-bs64-t1000": (1000, 2, 4, 128, 8, 64),
    "g5-bs64-t700-d64": (700, 2, 5, 64, 6, 64),
    "g7-bs128-t600": (600, 1, 7, 128, 3, 128),
    "g16-bs16-t200": (200, 1, 16, 128, 5, 16),
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


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_gluon_forward_matches_reference_and_triton(shape, monkeypatch):
    c = _case(shape)
    spy = _Count(fmsa_gluon.fmsa_fwd_gluon_kernel)
    monkeypatch.setattr(fmsa_gluon, "fmsa_fwd_gluon_kernel", spy)
    monkeypatch.setattr(fmsa, "FWD_GLUON", True)
    outs = assert_matches_reference("fmsa", c, "cuda")
    assert spy.n > 0, "the Gluon kernel did not run"
    monkeypatch.setattr(fmsa, "FWD_GLUON", False)
    o_triton = run("fmsa", c)[0]
    assert_close("gluon o vs triton o", outs[0].float(), o_triton.float(), tol=1e-2)


@pytest.mark.parametrize("chunk, heads", [(128, 1), (256, None)])
def test_gluon_forward_partitions(chunk, heads, monkeypatch):
    c = _case((700, 2, 4, 128, 6, 32), seed=1)
    monkeypatch.setattr(fmsa, "FWD_GLUON", True)
    assert_matches_reference("fmsa", c, "cuda", chunk_size=chunk, heads=heads)


def test_gluon_forward_fp16(monkeypatch):
    c = _case((500, 2, 5, 128, 6, 64), seed=2)
    c.q, c.k, c.v = (x.detach().half().requires_grad_() for x in (c.q, c.k, c.v))
    c.do = c.do.half()
    monkeypatch.setattr(fmsa, "FWD_GLUON", True)
    o_g = run("fmsa", c)[0]
    monkeypatch.setattr(fmsa, "FWD_GLUON", False)
    o_t = run("fmsa", c)[0]
    assert o_g.dtype == torch.float16
    assert_close("gluon fp16 o vs triton", o_g.float(), o_t.float(), tol=1e-2)
