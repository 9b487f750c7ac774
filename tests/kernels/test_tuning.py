"""flash_msa.tuning: the shipped launch tables are exactly the tuned settings (a change to them must
be a measured, deliberate one), and the override is scoped, checked and per thread."""
import threading

import pytest
import torch

from flash_msa import tuning
from flash_msa.compression import compress, dense_cmp, topk
from flash_msa import fused
from flash_msa.selection import fmsa, naive
from flash_msa.window import window

CUDA = torch.device("cuda")  # the tables are chosen by device type: no GPU needed to read them


def test_fmsa_table_is_the_tuned_one():
    assert dict(fmsa.LAUNCH) == dict(
        fwd_bm=64, fwd_warps=4, fwd_stages=2, fwd_tiles=4, fwd_maxnreg=128, fwd_tma=True, fwd_tma_stages=1,
        bwd_tma=True, bwd_bm=128, bwd_warps=8, bwd_stages=3, bwd_maxnreg=0, merge_warps_small_g=1, seg_tiles=64,
        partial_budget=768 << 20, partial_budget_per_token=6 << 10)
    cfg = fmsa.launch_settings()
    assert fmsa._fwd_stages(cfg, True, 64, 128) == 1 and fmsa._fwd_stages(cfg, False, 64, 128) == 2
    assert fmsa._fwd_stages(cfg, True, 128, 128) == 1
    assert fmsa._bwd_tile_rows(cfg, 128, 64) == 128 and fmsa._bwd_tile_rows(cfg, 128, 128) == 32
    assert fmsa._merge_warps(cfg, 4) == 1 and fmsa._merge_warps(cfg, 16) == 4


def test_range_attention_tables_are_the_tuned_ones():
    w4, w8 = dict(num_warps=4, num_stages=2), dict(num_warps=8, num_stages=3)
    assert window._tiles(128, CUDA, "cmp") == dict(
        BD=128, fwd=(128, 64, w8), dq=(64, 64, w4), dkdv=(64, 64, dict(DESC=True, **w4)))
    assert window._tiles(128, CUDA, "window") == dict(
        BD=128, fwd=(128, 32, dict(num_warps=4, num_stages=3)), dq=(128, 64, w8), dkdv=(64, 64, dict(DESC=False, **w4)))
    assert window._tiles(128, CUDA, "window", local=True)["dq"] == (64, 64, w4)
    assert window._tiles(64, CUDA, "cmp") == dict(
        BD=64, fwd=(128, 64, dict(num_warps=4, num_stages=3)), dq=(128, 64, dict(num_warps=8, num_stages=2)),
        dkdv=(64, 64, dict(DESC=True, **w4)))
    assert window._tiles(64, torch.device("cpu"), "window") == dict(
        BD=64, fwd=(64, 64, {}), dq=(64, 64, {}), dkdv=(64, 64, dict(DESC=False)))


def test_compress_topk_dense_cmp_fused_reference_tables_are_the_tuned_ones():
    assert compress._tiles(CUDA) == dict(
        fwd=(64, dict(num_warps=8, num_stages=3)), prep=(64, dict(num_warps=4, num_stages=1)),
        dx=(32, dict(num_warps=4, num_stages=2)), dw=(64, dict(num_warps=8, num_stages=2)),
        dw_split_rows=1024, dw_max_splits=8)
    assert topk._launch(CUDA) == dict(BT=64, tl_sort=True, key32=True, hybrid=True, pair=True,
                                      opts=dict(num_warps=4, num_stages=2, maxnreg=168))
    assert topk._launch(torch.device("cpu")) == dict(BT=64, key32=True, pair=True, opts={})
    assert dict(dense_cmp.SETTINGS) == dict(backend="auto", min_groups=2000, offsets_per_call=4, chunks=None)
    assert dense_cmp.chunk_count(16) == 4
    assert dict(fused.SETTINGS) == dict(local_in_window=True, single_function=True)
    assert fused.local_in_window("fmsa", 64, 16, 512) and not fused.local_in_window("qc", 64, 16, 512)
    assert dict(naive.SETTINGS) == dict(selected_dense_span=4)  # the PyTorch reference's (a CPU measurement)


def test_override_is_scoped_nested_and_per_thread():
    with tuning.override(fmsa=dict(fwd_warps=8)):
        assert fmsa.launch_settings()["fwd_warps"] == 8
        with tuning.override(fmsa=dict(seg_tiles=16), fused=dict(local_in_window=False)):
            cfg = fmsa.launch_settings()
            assert (cfg["fwd_warps"], cfg["seg_tiles"]) == (8, 16)  # merged, the inner one winning
            assert not fused.local_in_window("fmsa", 64, 16, 512)
        assert fmsa.launch_settings()["seg_tiles"] == 64
        seen = []
        t = threading.Thread(target=lambda: seen.append(fmsa.launch_settings()["fwd_warps"]))
        t.start()
        t.join()
        assert seen == [4]  # another thread keeps the tuned table
    assert fmsa.launch_settings() == fmsa.LAUNCH
    with tuning.override(range_attention=dict(fwd=(16, 16, {}))):
        assert window._tiles(128, CUDA, "cmp")["fwd"] == (16, 16, {})


def test_override_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown op 'fmsa_fwd'; ops: compress, dense_cmp, fmsa, fused"):
        with tuning.override(fmsa_fwd=dict(num_warps=8)):
            pass
    with pytest.raises(ValueError, match="fmsa has no setting 'FWD_WARPS'"):
        with tuning.override(fmsa=dict(FWD_WARPS=8)):
            pass
    with pytest.raises(TypeError, match="topk= must be a dict"):
        with tuning.override(topk=64):
            pass
