"""flash_msa.utils.compare.rel_rms: the relative error every kernel check uses."""
import math

import pytest
import torch

from flash_msa.utils.compare import rel_rms


def test_rel_rms_chunked_equals_direct_formula():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(37, 3, 8, generator=g)
    x = ref + 1e-3 * torch.randn(37, 3, 8, generator=g)
    direct = ((x.double() - ref.double()).pow(2).sum() / ref.double().pow(2).sum()).sqrt().item()
    for chunk in (1, 5, 111, 1 << 20):  # chunk boundaries inside and beyond the 111 rows
        assert math.isclose(rel_rms(x, ref, chunk_rows=chunk), direct, rel_tol=1e-12)
    assert rel_rms(ref.to(torch.bfloat16), ref.to(torch.bfloat16)) == 0.0


def test_rel_rms_nan_fails_any_bound_and_shapes_must_match():
    ref = torch.ones(4, 2)
    x = ref.clone()
    x[3, 1] = float("nan")
    assert not rel_rms(x, ref) <= 1.0
    assert not rel_rms(ref, x) <= 1.0
    with pytest.raises(ValueError, match="shape"):
        rel_rms(torch.ones(4, 2), torch.ones(2, 4))
    assert rel_rms(torch.tensor(2.0), torch.tensor(1.0)) == 1.0  # 0-dim
