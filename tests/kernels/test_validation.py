"""Every public flash_msa function rejects bad input with an error naming the argument."""
import pytest
import torch

import flash_msa

T, HQ, HK, D = 32, 4, 2, 8


def qkv(**over):
    t = dict(q=torch.randn(1, T, HQ, D), k=torch.randn(1, T, HK, D), v=torch.randn(1, T, HK, D))
    t.update(over)
    return t


def idx(S=2, at=None, t=20):
    """Block 0 for every query; with ``at``, entry 1 of query t, KV head 1 set to it."""
    bi = torch.full((1, T, HK, S), -1, dtype=torch.int32)
    bi[..., 0] = 0
    if at is not None:
        bi[0, t, 1, 1] = at
    return bi


def test_in_range_entries_accepted():
    """Entries up to the last block of the query's own sequence pass, past the query's own block
    too (they are ignored)."""
    t = qkv()
    bi = idx(at=1, t=12)  # sequence [10, 32): blocks 0 and 1; token 12 is in block 0
    o = flash_msa.selected_attention(t["q"], t["k"], t["v"], bi, block_size=16, cu_seqlens=CU, impl="reference")
    assert torch.isfinite(o).all()


CU = torch.tensor([0, 10, T], dtype=torch.int32)

SELECTED_CASES = {
    "q_rank": (dict(q=torch.randn(T, HQ, D)), {}, ValueError, "q must have shape"),
    "k_shape": (dict(k=torch.randn(1, T + 1, HK, D)), {}, ValueError, "k and v must have the same shape"),
    "kv_T": (dict(k=torch.randn(1, T + 1, HK, D), v=torch.randn(1, T + 1, HK, D)), {}, ValueError, "k must have shape"),
    "heads": (dict(k=torch.randn(1, T, 3, D), v=torch.randn(1, T, 3, D)), {}, ValueError, "multiple of the KV heads"),
    "group_too_big": (dict(q=torch.randn(1, T, 34, D)), {}, ValueError, "between 1 and 16"),
    "no_query_heads": (dict(q=torch.randn(1, T, 0, D)), {}, ValueError, "HQ=0 must be a positive multiple"),
    "empty_batch": (dict(q=torch.randn(0, T, HQ, D), k=torch.randn(0, T, HK, D), v=torch.randn(0, T, HK, D)), {},
                    ValueError, "at least one sequence"),
    "zero_head_dim": (dict(q=torch.randn(1, T, HQ, 0), k=torch.randn(1, T, HK, 0), v=torch.randn(1, T, HK, 0)), {},
                      ValueError, "head dim D must be at least 1"),
    "dtype_mismatch": (dict(k=torch.randn(1, T, HK, D, dtype=torch.float64)), {}, TypeError, "one dtype"),
    "int_q": (dict(q=torch.zeros(1, T, HQ, D, dtype=torch.int32)), {}, TypeError, "q must have dtype"),
    "cu_dtype": ({}, dict(cu_seqlens=CU.long()), TypeError, "cu_seqlens must have dtype int32"),
    "cu_start": ({}, dict(cu_seqlens=torch.tensor([1, 10, T], dtype=torch.int32)), ValueError, "start at 0"),
    "cu_decreasing": ({}, dict(cu_seqlens=torch.tensor([0, 20, 10, T], dtype=torch.int32)), ValueError, "non-decreasing"),
    "cu_end": ({}, dict(cu_seqlens=torch.tensor([0, 10, T - 1], dtype=torch.int32)), ValueError, "end at the number of tokens"),
    "cu_rank": ({}, dict(cu_seqlens=torch.tensor([[0, T]], dtype=torch.int32)), ValueError, "cu_seqlens must have shape"),
    "idx_dtype": ({}, dict(block_indices=torch.zeros(1, T, HK, 2, dtype=torch.int64)), TypeError, "block_indices must have dtype int32"),
    "idx_shape": ({}, dict(block_indices=torch.zeros(1, T, HQ, 2, dtype=torch.int32)), ValueError, "block_indices must have shape"),
    "block_size": ({}, dict(block_size=48), ValueError, "block_size must be one of"),
    "impl": ({}, dict(impl="triton"), ValueError, "impl must be one of"),
    "scale": ({}, dict(scale=-1.0), ValueError, "scale must be a finite positive"),
    "scale_inf": ({}, dict(scale=float("inf")), ValueError, "scale must be a finite positive"),
    "scale_nan": ({}, dict(scale=float("nan")), ValueError, "scale must be a finite positive"),
    "idx_100": ({}, dict(block_indices=idx(at=100)), ValueError, r"block_indices must lie in \[-1, n_blocks\).*= 100"),
    "idx_minus_5": ({}, dict(block_indices=idx(at=-5)), ValueError, r"block_indices must lie in \[-1, n_blocks\).*= -5"),
    "idx_2_30": ({}, dict(block_indices=idx(at=2 ** 30)), ValueError, r"block_indices must lie in \[-1, n_blocks\)"),
    # T = 32 tokens in blocks of 16: blocks 0 and 1 exist, 2 does not
    "idx_past_stream": ({}, dict(block_indices=idx(at=2)), ValueError, r"block_indices\[0, 20, 1, 1\] = 2, n_blocks = 2"),
    # the sequence [10, 32) has 22 tokens: blocks 0 and 1; the sequence [0, 10) only block 0
    "idx_past_sequence": ({}, dict(block_indices=idx(at=1, t=5), cu_seqlens=CU), ValueError,
                          r"block_indices\[0, 5, 1, 1\] = 1, n_blocks = 1"),
}


@pytest.mark.parametrize("case", list(SELECTED_CASES))
def test_selected_attention_errors(case):
    tensors, kwargs, exc, msg = SELECTED_CASES[case]
    args = qkv(**tensors)
    call = dict(block_indices=idx(), block_size=16, impl="reference")
    call.update(kwargs)
    bi = call.pop("block_indices")
    with pytest.raises(exc, match=msg):
        flash_msa.selected_attention(args["q"], args["k"], args["v"], bi, **call)


def test_repeated_block_index_rejected():
    t = qkv()
    bi = torch.full((1, T, HK, 3), -1, dtype=torch.int32)
    bi[0, 20, 1, 0] = bi[0, 20, 1, 2] = 1
    with pytest.raises(ValueError, match=r"distinct entries per query .*block_indices\[0, 20, 1\] repeats block 1"):
        flash_msa.selected_attention(t["q"], t["k"], t["v"], bi, block_size=16, impl="reference")


def test_batched_cu_seqlens_rejected():
    t = qkv(q=torch.randn(2, T, HQ, D), k=torch.randn(2, T, HK, D), v=torch.randn(2, T, HK, D))
    with pytest.raises(ValueError, match="B == 1"):
        flash_msa.selected_attention(t["q"], t["k"], t["v"], torch.zeros(2, T, HK, 1, dtype=torch.int32),
                                     block_size=16, cu_seqlens=CU, impl="reference")


def test_unavailable_impl_names_the_available_ones(monkeypatch):
    from flash_msa.selection import interface
    monkeypatch.setattr(interface, "IMPLS", {"reference": interface.IMPLS["reference"]})
    t = qkv()
    with pytest.raises(NotImplementedError, match="available: auto, reference"):
        flash_msa.selected_attention(t["q"], t["k"], t["v"], idx(), block_size=16, impl="fmsa")


def nsa_args(D=D, **over):
    block = over.pop("block", 16)
    a = dict(**qkv(), gates=torch.rand(1, T, HQ, 3),
             k_cmp_weight=torch.randn(HK, block * D, D), k_cmp_pos=torch.randn(HK, block, D),
             v_cmp_weight=torch.randn(HK, block * D, D), v_cmp_pos=torch.randn(HK, block, D))
    a.update(over)
    return a


NSA_CASES = {
    "gates_shape": (dict(gates=torch.rand(1, T, HQ, 2)), {}, "gates must have shape"),
    "gates_device": (dict(gates=torch.rand(1, T, HQ, 3, device="meta")), {}, r"gates must be on the device of q \(cpu\)"),
    "gates_negative": (dict(gates=torch.rand(1, T, HQ, 3).index_fill_(1, torch.tensor([3]), -0.5)), {},
                       r"gates must lie in \[0, 1\].*gates\[0, 3, 0, 0\] = -0.5"),
    "gates_nan": (dict(gates=torch.rand(1, T, HQ, 3).index_fill_(2, torch.tensor([1]), float("nan"))), {},
                  r"gates must lie in \[0, 1\]"),
    "cmp_weight_shape": (dict(k_cmp_weight=torch.randn(HK, 8 * D, D)), {}, "k_cmp_weight must have shape"),
    "cmp_pos_shape": (dict(v_cmp_pos=torch.randn(HK, 8, D)), {}, "v_cmp_pos must have shape"),
    "cmp_proj_shape": (dict(k_cmp_proj=torch.randn(HK, D, 2 * D)), {}, "k_cmp_proj must have shape"),
    "cmp_block": ({}, dict(cmp_block=24), "cmp_block must be one of"),
    "stride_divides": ({}, dict(cmp_block=16, cmp_stride=32), "multiple of cmp_stride"),
    "slc_block": ({}, dict(slc_block=40), "slc_block must be one of"),
    "topk": ({}, dict(slc_topk=0), "slc_topk must be an int"),
    "window": ({}, dict(window=0), "window must be a positive int"),
    "scale_inf": ({}, dict(scale=float("inf")), "scale must be a finite positive"),
    "scale_zero": ({}, dict(scale=0.0), "scale must be a finite positive"),
}


@pytest.mark.parametrize("case", list(NSA_CASES))
def test_nsa_attention_errors(case):
    tensors, kwargs, msg = NSA_CASES[case]
    a = nsa_args(**tensors)
    sizes = dict(cmp_block=16, cmp_stride=8, slc_block=16, slc_topk=4, window=8, impl="reference")
    sizes.update(kwargs)
    with pytest.raises(ValueError, match=msg):
        flash_msa.nsa_attention(**a, **sizes)


def test_module_errors():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        flash_msa.NativeSparseAttention(16, 5, 2, 8)
    with pytest.raises(ValueError, match="slc_block must be one of"):
        flash_msa.NativeSparseAttention(16, 4, 2, 8, slc_block=100)
    m = flash_msa.NativeSparseAttention(16, HQ, HK, D, cmp_block=16, cmp_stride=8, slc_block=16, slc_topk=2, window=8)
    t = qkv()
    with pytest.raises(ValueError, match="hidden_states must have shape"):
        m(torch.randn(1, T + 1, 16), t["q"], t["k"], t["v"])
    with pytest.raises(ValueError, match=r"hidden_states must have shape \[B, T, hidden=16\].*got \(1, 32, 24\)"):
        m(torch.randn(1, T, 24), t["q"], t["k"], t["v"])


def test_decode_checks_hidden_size_and_scale():
    m = flash_msa.NativeSparseAttention(16, HQ, HK, D, cmp_block=16, cmp_stride=8, slc_block=16, slc_topk=2, window=8)
    t = qkv()
    q = t["q"][:, -1:]
    with pytest.raises(ValueError, match=r"hidden_states must have shape \[B, T, hidden=16\]"):
        m.decode(torch.randn(1, 1, 24), q, t["k"], t["v"])
    with pytest.raises(ValueError, match="scale must be a finite positive"):
        m.decode(torch.randn(1, 1, 16), q, t["k"], t["v"], scale=float("inf"))


@pytest.mark.parametrize("impl", ["fmsa", "qc"])
def test_kernels_on_cpu_without_the_interpreter_say_so(impl, monkeypatch):
    """An explicit kernel on a CPU tensor raises in both public ops alike (selection.interface.
    resolve_impl), never a silent run of the reference."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    t = qkv(q=torch.randn(1, T, HQ, 16), k=torch.randn(1, T, HK, 16), v=torch.randn(1, T, HK, 16))  # a kernel head dim
    with pytest.raises(ValueError, match="need CUDA tensors, q is on cpu.*impl='reference'"):
        flash_msa.selected_attention(t["q"], t["k"], t["v"], idx(), block_size=16, impl=impl)
    a = nsa_args(q=t["q"], k=t["k"], v=t["v"], D=16)
    with pytest.raises(ValueError, match="need CUDA tensors, q is on cpu.*impl='reference'"):
        flash_msa.nsa_attention(**a, cmp_block=16, cmp_stride=8, slc_block=16, slc_topk=2, window=8, impl=impl)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter only: Triton reads TRITON_INTERPRET when a "
                    "kernel is decorated, and with CUDA tests/conftest.py leaves it unset (the kernels compile)")
def test_nsa_attention_runs_the_kernels_it_names_under_the_interpreter(monkeypatch):
    """Under TRITON_INTERPRET=1 an explicit kernel runs the Triton branches on CPU (the single
    Function of flash_msa/fused.py), "reference" and "auto" the PyTorch reference."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    t = qkv(q=torch.randn(1, T, HQ, 16), k=torch.randn(1, T, HK, 16), v=torch.randn(1, T, HK, 16))
    a = nsa_args(q=t["q"].requires_grad_(), k=t["k"], v=t["v"], D=16)
    sizes = dict(cmp_block=16, cmp_stride=8, slc_block=16, slc_topk=2, window=8)
    for impl, fused in (("fmsa", True), ("qc", True), ("reference", False), ("auto", False)):
        fn = flash_msa.nsa_attention(**a, **sizes, impl=impl).grad_fn
        while fn.name() in ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"):
            fn = fn.next_functions[0][0]
        assert ("NSAAttentionFunction" in fn.name()) == fused, impl


def test_trusted_inputs_is_per_thread_and_never_on_cpu(monkeypatch):
    import threading

    from flash_msa.utils.validation import _trusting

    acc, cpu = torch.empty(2, device="meta"), torch.empty(2)  # "meta" stands for an accelerator
    assert not _trusting(acc)
    seen = []
    with flash_msa.trusted_inputs():
        assert _trusting(acc) and not _trusting(cpu)
        t = threading.Thread(target=lambda: seen.append(_trusting(acc)))
        t.start()
        t.join()
    assert seen == [False] and not _trusting(acc)  # another thread kept its checks; restored after
    monkeypatch.setenv("FLASH_MSA_TRUST_INPUTS", "1")  # no environment switch: only the context trusts
    assert not _trusting(acc)
    with pytest.raises(ValueError, match="must start at 0"):  # CPU values are always checked
        with flash_msa.trusted_inputs():
            t = qkv()
            flash_msa.selected_attention(t["q"], t["k"], t["v"], idx(), block_size=16, impl="reference",
                                         cu_seqlens=torch.tensor([1, 10, T], dtype=torch.int32))
