"""scripts/bench_nsa.py --compare-settings: parsing into flash_msa.tuning overrides, names checked
before any timing, and the variants' markdown section (a failed variant keeps its row and its error)."""
import importlib.util
from pathlib import Path

import pytest

from flash_msa import tuning
from flash_msa.selection import fmsa

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_nsa", ROOT / "scripts" / "bench_nsa.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_parse_settings():
    b = _bench()
    variants = b.parse_settings("fmsa.seg_tiles=32;fmsa.bwd_stages=2,fmsa.seg_tiles=16")
    assert variants == [{"fmsa": {"seg_tiles": 32}}, {"fmsa": {"bwd_stages": 2, "seg_tiles": 16}}]
    assert b.settings_label(variants[1]) == "fmsa.bwd_stages=2 fmsa.seg_tiles=16"
    with pytest.raises(ValueError, match="op.name=value"):
        b.parse_settings("seg_tiles")
    # commas inside brackets belong to the value (tile entries)
    assert b.parse_settings("range_attention.dq=(64, 64, {'num_warps': 4}),fmsa.seg_tiles=8;fused.local_in_window=False") == [
        {"range_attention": {"dq": (64, 64, {"num_warps": 4})}, "fmsa": {"seg_tiles": 8}},
        {"fused": {"local_in_window": False}}]
    with tuning.override(**variants[1]):
        cfg = fmsa.launch_settings()
        assert (cfg["bwd_stages"], cfg["seg_tiles"]) == (2, 16)
    assert fmsa.launch_settings() == fmsa.LAUNCH
    # a misspelt name is refused as a whole (the script checks every variant before timing)
    with pytest.raises(ValueError, match="fmsa has no setting 'no_such_setting'"):
        with tuning.override(**b.parse_settings("fmsa.seg_tiles=8,fmsa.no_such_setting=1")[0]):
            pass


def test_variants_markdown(tmp_path):
    b = _bench()
    row = dict(model="llama3_8b", T=65536, nsa_fwd_ms=19.0, nsa_fwd_bwd_ms=53.5, nsa_peak_mib=3904.0,
               var0_spec="m.A=1", var0_max_rel_rms=1e-5, var0_fwd_ms=19.3, var0_fwd_bwd_ms=54.7, var0_peak_mib=3633.0,
               var1_spec="m.B=2", var1_error="OutOfMemoryError: no",
               shipped_again_fwd_ms=19.7, shipped_again_fwd_bwd_ms=54.3, shipped_again_peak_mib=3904.0)
    b.write_markdown({"meta": {}, "rows": [row], "checks": {}}, tmp_path / "nsa.md")
    md = (tmp_path / "nsa.md").read_text()
    assert "| llama3_8b | 65536 | `shipped` | 19.0 | 53.5 | 3904 | - |" in md
    assert "| llama3_8b | 65536 | `m.A=1` | 19.3 | 54.7 | 3633 | 1.0e-05 |" in md
    assert "| llama3_8b | 65536 | `m.B=2` | - | - | - | - |" in md
    assert "| llama3_8b | 65536 | `shipped, again` | 19.7 | 54.3 | 3904 | - |" in md
    assert "var1_error: OutOfMemoryError: no" in md
