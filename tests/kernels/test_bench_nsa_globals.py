"""scripts/bench_nsa.py --compare-globals: parsing, all-or-none setting and restoring of module
globals, and the variants' markdown section (a failed variant keeps its row and its error)."""
import importlib.util
from pathlib import Path

import pytest

from flash_msa.selection import fmsa

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_nsa", ROOT / "scripts" / "bench_nsa.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_parse_and_set_globals():
    b = _bench()
    m = "flash_msa.selection.fmsa"
    variants = b.parse_globals(f"{m}.SEG_TILES=32;{m}.BWD_STAGES=2,{m}.SEG_TILES=16")
    assert variants == [[(m, "SEG_TILES", 32)], [(m, "BWD_STAGES", 2), (m, "SEG_TILES", 16)]]
    with pytest.raises(ValueError, match="module.NAME=value"):
        b.parse_globals("SEG_TILES")
    # commas inside brackets belong to the value (tile dicts of TILE_OVERRIDE)
    w = "flash_msa.window.window"
    assert b.parse_globals(f"{w}.TILE_OVERRIDE={{'dq': (64, 64, {{'num_warps': 4}})}},{m}.SEG_TILES=8;{m}.X=(1, 2)") == [
        [(w, "TILE_OVERRIDE", {"dq": (64, 64, {"num_warps": 4})}), (m, "SEG_TILES", 8)], [(m, "X", (1, 2))]]
    seg, stages = fmsa.SEG_TILES, fmsa.BWD_STAGES
    old = b.set_globals(variants[1])
    try:
        assert (fmsa.BWD_STAGES, fmsa.SEG_TILES) == (2, 16)
    finally:
        b.set_globals(old)
    assert (fmsa.SEG_TILES, fmsa.BWD_STAGES) == (seg, stages)
    # a misspelt name sets nothing, not even the names before it
    with pytest.raises(AttributeError, match="NO_SUCH_GLOBAL"):
        b.set_globals([(m, "SEG_TILES", 8), (m, "NO_SUCH_GLOBAL", 1)])
    assert fmsa.SEG_TILES == seg


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
