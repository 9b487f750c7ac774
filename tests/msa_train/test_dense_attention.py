"""attention=full's dense kernels: the host-side routing, and every route against a plain reference."""
import pytest
import torch

from msa_train.models import attention as att


def _reference(q, k, v, cu, scale):
    """q [1, HQ, T, D], k/v [1, HK, T, D] -> [1, T, HQ, D]: causal softmax within each document, fp32."""
    HQ, T = q.shape[1], q.shape[2]
    g = HQ // k.shape[1]
    k, v = k.repeat_interleave(g, 1).double(), v.repeat_interleave(g, 1).double()
    s = q.double() @ k.transpose(-1, -2) * scale
    doc = torch.bucketize(torch.arange(T), cu[1:], right=True)
    pos = torch.arange(T)
    allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (p @ v).transpose(1, 2).float()


def _qkv(T, HQ=4, HK=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, T, D, generator=g) for h in (HQ, HK, HK)]


def _per_document(q, k, v, cu, scale):
    """The packed contract on [T, H, D] (KV heads dividing query heads): SDPA's math path, causal
    within each document of the offsets ``cu``."""
    b = cu.tolist()
    return torch.cat([torch.nn.functional.scaled_dot_product_attention(
        q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), is_causal=True, scale=scale,
        enable_gqa=True).transpose(0, 1) for s, e in zip(b[:-1], b[1:])])


@pytest.mark.parametrize("cuda,dtype,docs,varlen,expect", [
    (True, torch.bfloat16, 1, True, att.SDPA_CUDNN),
    (True, torch.float16, 1, False, att.SDPA_CUDNN),
    (True, torch.bfloat16, 5, True, att.VARLEN_FLASH),
    (True, torch.bfloat16, 5, False, att.SDPA_PER_DOCUMENT),  # torch without varlen_attn
    (True, torch.float32, 5, True, att.SDPA_PER_DOCUMENT),    # the varlen kernel takes half precision only
    (True, torch.float32, 1, True, att.SDPA),
    (False, torch.bfloat16, 1, True, att.SDPA),
    (False, torch.float32, 3, True, att.SDPA_PER_DOCUMENT),
], ids=["cuda-1doc", "cuda-1doc-novarlen", "cuda-packed", "cuda-packed-novarlen", "cuda-packed-fp32",
        "cuda-1doc-fp32", "cpu-1doc", "cpu-packed"])
def test_routing(cuda, dtype, docs, varlen, expect):
    assert att.dense_kernel_name(cuda, dtype, docs, varlen) == expect


@pytest.mark.parametrize("kernel,bounds", [
    (att.SDPA_CUDNN, [0, 111]), (att.SDPA, [0, 111]), (att.SDPA_PER_DOCUMENT, [0, 111]),
    (att.SDPA_PER_DOCUMENT, [0, 63, 100, 111])], ids=["cudnn-first", "sdpa", "per-document", "per-document-3docs"])
def test_each_sdpa_route_computes_the_reference(monkeypatch, kernel, bounds):
    q, k, v = _qkv(bounds[-1])
    cu = torch.tensor(bounds, dtype=torch.int32)
    # forced route (on CPU the cuDNN route's backend list falls through to SDPA's math backend)
    monkeypatch.setattr(att, "dense_kernel_name", lambda *a: kernel)
    out = att._full_attention(q, k, v, 0.3, cu, max(b - a for a, b in zip(bounds, bounds[1:])))
    torch.testing.assert_close(out, _reference(q, k, v, cu, 0.3), rtol=1e-4, atol=1e-5)


def test_the_varlen_route_passes_the_packed_layout_gqa_and_causality(monkeypatch):
    bounds = [0, 40, 41, 111]
    q, k, v = _qkv(bounds[-1])
    cu = torch.tensor(bounds, dtype=torch.int32)
    calls = []

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        """torch's varlen_attn contract on [T, H, D], computed per document with SDPA's math path."""
        calls.append((max_q, window_size, enable_gqa))
        assert q.shape == (111, 4, 16) and k.shape == (111, 2, 16) and enable_gqa and window_size == (-1, 0)
        return _per_document(q, k, v, cu_q, scale)

    monkeypatch.setattr(att, "_varlen_attn", fake_varlen)
    monkeypatch.setattr(att, "_VARLEN_PARAMS", {"scale", "window_size", "enable_gqa"})
    monkeypatch.setattr(att, "_VARLEN_GQA", True)
    monkeypatch.setattr(att, "_VARLEN_CAUSAL", {"window_size": (-1, 0)})
    monkeypatch.setattr(att, "dense_kernel_name", lambda *a: att.VARLEN_FLASH)
    out = att._full_attention(q, k, v, 0.25, cu, 70)
    assert calls == [(70, (-1, 0), True)]
    torch.testing.assert_close(out, _reference(q, k, v, cu, 0.25), rtol=1e-4, atol=1e-5)
