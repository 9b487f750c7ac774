"""Shared assertions for the test suite."""
import torch

from flash_msa.utils.compare import rel_rms  # noqa: F401  (re-exported for the tests)


def assert_close(name: str, x: torch.Tensor, ref: torch.Tensor, tol: float = 5e-3) -> None:
    assert x.shape == ref.shape, f"{name}: shape {tuple(x.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(x).all(), f"{name}: non-finite values"
    err = rel_rms(x, ref)
    assert err <= tol, f"{name}: relative RMS error {err:.3e} > {tol:.1e}"
