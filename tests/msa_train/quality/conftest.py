"""A fake site-packages of real text (this repository's own sources and docs, as four packages)."""
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def make_site_packages(root: Path) -> Path:
    site = root / "site-packages"
    groups = {"alpha": sorted((REPO / "msa_train" / "data").glob("*.py")),
              "beta_pkg": sorted((REPO / "docs").glob("d*.md")),
              "gamma": sorted((REPO / "msa_train" / "models").glob("*.py")),
              "delta": sorted((REPO / "kernels" / "flash_msa" / "window").glob("*.py"))}
    for name, files in groups.items():
        for f in files:
            dest = site / name / ("sub" if f.suffix == ".md" and "dispatch" in f.name else "") / f.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, dest)
    info = site / "delta-1.0.dist-info"
    info.mkdir()
    (info / "LICENSE").write_text("Permission is granted to use this fake package for tests.\n" * 20)
    (info / "RECORD").write_text("not read\n")
    (site / "alpha" / "blob.bin").write_bytes(b"\x00\x01binary")
    (site / "__pycache__").mkdir()
    return site


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """(site-packages dir, corpus dir, manifest), built once for the session's tests."""
    from msa_train.quality.corpus import build_corpus

    root = tmp_path_factory.mktemp("quality")
    site = make_site_packages(root)
    manifest = build_corpus(str(root / "work" / "corpus"), [str(site)], vocab_size=300, heldout_fraction=0.2)
    return site, root / "work" / "corpus", manifest
