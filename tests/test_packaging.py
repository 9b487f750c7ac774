"""pyproject.toml lists its packages by hand (flash_msa lives under kernels/, the Hydra configs
at the top): keep that list equal to the source tree, and check that a regular (non-editable)
install runs the CLI from any directory with the configs it ships."""
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _setuptools():
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_package_list_matches_the_source_tree():
    tree = {".".join(p.parent.relative_to(REPO / root).parts)
            for root in (".", "kernels") for pkg in ("msa_train", "flash_msa")
            for p in (REPO / root / pkg).rglob("__init__.py") if (REPO / root / pkg).is_dir()}
    listed = set(_setuptools()["packages"])
    assert tree <= listed, f"packages missing from pyproject.toml: {sorted(tree - listed)}"
    assert listed - tree == {"msa_train._configs", "msa_train._recipes"}


@pytest.mark.slow
def test_wheel_ships_configs_and_the_cli_runs_from_it(tmp_path):
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                            "-w", str(tmp_path / "dist"), str(REPO)], capture_output=True, text=True, cwd=tmp_path)
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("msa_train-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    configs = {n for n in names if n.startswith("msa_train/_configs/")}
    assert {f"msa_train/_configs/{p.relative_to(REPO / 'configs')}" for p in (REPO / "configs").rglob("*.yaml")} == configs
    assert {f"msa_train/_recipes/{p.name}" for p in (REPO / "recipes").glob("*.yaml")} == \
        {n for n in names if n.startswith("msa_train/_recipes/")}
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    out = subprocess.run([sys.executable, "-c", "import sys; sys.argv = ['msa-train', '--help']; "
                          "from msa_train.cli import main; main()"],
                         capture_output=True, text=True, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "site"),
                                                                             "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tiny" in out.stdout and "qwen3_14b_1m" in out.stdout
    assert str(tmp_path / "site") in subprocess.run(
        [sys.executable, "-c", "from msa_train import cli; print(cli.CONFIG_DIR)"],
        capture_output=True, text=True, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "site")}).stdout
