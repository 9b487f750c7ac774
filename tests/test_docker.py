"""docker/Dockerfile and .dockerignore agree with README.md and pyproject.toml (the image itself
cannot be built in CI: no Docker daemon)."""
from __future__ import annotations

import fnmatch
import re
import shlex
from pathlib import Path

from packaging.requirements import Requirement

from tests.test_readme import _blocks, parts

ROOT = Path(__file__).resolve().parents[1]


def dockerfile_runs(text: str) -> list[list[str]]:
    """The argv of every command of every RUN instruction (continuations joined, ``&&`` split)."""
    logical, cur = [], ""
    for ln in text.splitlines():
        if not cur and (not ln.strip() or ln.lstrip().startswith("#")):
            continue
        cur += ln.rstrip()
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        logical.append(cur.strip())
        cur = ""
    out = []
    for ins in logical:
        keyword, _, rest = ins.partition(" ")
        if keyword.upper() == "RUN":
            out += [p for p in parts(rest) if p]
    return out


def readme_install() -> list[str]:
    return parts(_blocks()[0].commands[0])[0]


def torch_pins(argv: list[str]) -> list[Requirement]:
    """The torch requirements of a ``pip install`` argv (options and paths left out)."""
    args = [a for i, a in enumerate(argv[2:]) if not a.startswith(("-", ".", "/")) and argv[1 + i] not in ("-e", "--index-url")]
    return [r for r in map(Requirement, args) if r.name == "torch"]


def test_dockerfile_installs_what_the_readme_says():
    runs = dockerfile_runs((ROOT / "docker" / "Dockerfile").read_text())
    installs = [r for r in runs if r[:2] == ["pip", "install"] and "-e" in r]
    assert installs == [readme_install()], f"Dockerfile's editable install {installs} is not README's {readme_install()}"
    # no other torch install beside it (a second pin would decide which build the image gets)
    others = [r for r in runs if r[:2] == ["pip", "install"] and r not in installs]
    assert not any(torch_pins(r) for r in others), others


def test_readme_torch_pin_satisfies_the_pyproject_floor():
    # pyproject's dependency line for torch (read as text: tomllib needs Python 3.11, we support 3.10)
    (line,) = re.findall(r'^\s*"(torch[<>=!~ ][^"]*)",', (ROOT / "pyproject.toml").read_text(), flags=re.M)
    floor = Requirement(line)
    (pin,) = torch_pins(readme_install())
    (version,) = [s.version for s in pin.specifier if s.operator == "=="]
    assert floor.specifier.contains(version), f"README pins torch {version}, pyproject needs {floor.specifier}"


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule for the patterns used here: a pattern matches the path or one of its parents."""
    pieces = path.split("/")
    prefixes = ["/".join(pieces[:i]) for i in range(1, len(pieces) + 1)]
    return any(fnmatch.fnmatchcase(p, pat) or fnmatch.fnmatchcase(p, pat.removeprefix("**/"))
               or fnmatch.fnmatchcase(p.split("/")[-1], pat.removeprefix("**/"))
               for pat in patterns for p in prefixes)


def test_dockerignore_keeps_what_the_install_needs_and_drops_local_state():
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    assert not any(p.startswith("!") for p in patterns)  # _ignored does not model exceptions
    needed = ["pyproject.toml", "README.md", "msa_train/cli.py", "kernels/flash_msa/nsa.py",
              "configs/config.yaml", "recipes/tiny.yaml", "tests/conftest.py"]
    assert [p for p in needed if _ignored(p, patterns)] == []
    assert all((ROOT / p).exists() for p in needed)
    for local in [".git/HEAD", ".venv/bin/python", "runs/tiny/metrics.jsonl", "msa_train/__pycache__/cli.pyc",
                  "msa_train.egg-info/PKG-INFO"]:
        assert _ignored(local, patterns), f".dockerignore lets {local} into the image"


def test_dockerfile_parser_reads_continuations_and_chains():
    text = "FROM x\n# comment\nRUN apt-get update && \\\n    pip install 'torch>=2' -e .\nENV A=1\n"
    assert dockerfile_runs(text) == [["apt-get", "update"], ["pip", "install", "torch>=2", "-e", "."]]
    assert shlex.join(dockerfile_runs(text)[1]) == "pip install 'torch>=2' -e ."
