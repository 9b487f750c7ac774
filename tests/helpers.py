"""Shared assertions for the test suite."""
import torch


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64; NaN anywhere makes it NaN (so it fails any bound)."""
    x, ref = x.double(), ref.double()
    num = (x - ref).pow(2).mean().sqrt()
    den = ref.pow(2).mean().sqrt().clamp_min(1e-30)
    return (num / den).item()


def assert_close(name: str, x: torch.Tensor, ref: torch.Tensor, tol: float = 5e-3) -> None:
    assert x.shape == ref.shape, f"{name}: shape {tuple(x.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(x).all(), f"{name}: non-finite values"
    err = rel_rms(x, ref)
    assert err <= tol, f"{name}: relative RMS error {err:.3e} > {tol:.1e}"
