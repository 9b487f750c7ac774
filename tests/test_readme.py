"""README.md's commands run as written, in order, on a fresh clone.

Every ```bash block of the README is a list of commands a new user types in order. A block
preceded by ``<!-- not run by tests/test_readme.py: REASON -->`` needs what CI lacks (GPUs,
model weights, data); its commands must still compose into valid configs. The fast tests
check, without training, that the setup commands are the ones .ci/run runs, that every
``msa-train`` command composes, and that the commands fit together (each fresh run has a run
directory of its own, a resume raises the step count, every file a command reads exists or
an earlier command writes it). The slow test runs the runnable commands in a copy of the
checkout, with overrides appended to each ``msa-train`` command that make it small.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SKIP_MARK = "<!-- not run by tests/test_readme.py:"
# What the slow test appends to every msa-train command: short sequences, a small generated
# corpus, a small evaluation, no progress bar. Steps are set per command (see _small_steps).
SMALL = ["train.seq_len=256", "train.warmup_steps=1", "data.num_docs=40", "data.max_doc_tokens=768",
         "eval.max_sequences=2", "train.progress=false"]


@dataclass
class Block:
    line: int            # 1-based line of the opening fence
    skip: str | None     # the marker's reason, or None for a block the slow test runs
    commands: list[str]  # one shell command line each (continuations joined, comments kept out)


def readme_blocks(text: str) -> list[Block]:
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```bash":
            prev = next((ln.strip() for ln in reversed(lines[:i]) if ln.strip()), "")
            skip = prev[len(SKIP_MARK):].rstrip("->").strip() if prev.startswith(SKIP_MARK) else None
            body, j = [], i + 1
            while lines[j].strip() != "```":
                body.append(lines[j])
                j += 1
            commands, cur = [], ""
            for ln in body:
                cur += ln.rstrip()
                if cur.endswith("\\"):
                    cur = cur[:-1] + " "
                    continue
                if shlex.split(cur, comments=True):
                    commands.append(cur)
                cur = ""
            blocks.append(Block(i + 1, skip, commands))
            i = j
        i += 1
    return blocks


def parts(command: str) -> list[list[str]]:
    """The argv of each command of a ``a && b`` line (comments dropped)."""
    out, cur = [], []
    for tok in shlex.split(command, comments=True):
        if tok == "&&":
            out.append(cur)
            cur = []
        else:
            cur.append(tok)
    return out + [cur]


def msa_train_overrides(argv: list[str]) -> list[str] | None:
    """The Hydra overrides of an ``msa-train`` / ``torchrun ... -m msa_train.cli`` argv, else None."""
    if argv[0] == "msa-train":
        return argv[1:]
    if argv[0] == "torchrun" and "msa_train.cli" in argv:
        return argv[argv.index("msa_train.cli") + 1:]
    return None


def _ci_line(prefix: str) -> list[str]:
    for ln in (ROOT / ".ci" / "run").read_text().splitlines():
        if ln.strip().startswith(prefix):
            return shlex.split(ln)
    raise AssertionError(f".ci/run has no line starting with {prefix!r}")


def _blocks() -> list[Block]:
    return readme_blocks(README.read_text())


def test_readme_has_runnable_blocks_and_reasons_for_the_others():
    blocks = _blocks()
    assert blocks, "README.md has no ```bash block"
    assert all(b.skip is None or b.skip for b in blocks), "a skip marker without a reason"
    runnable = [p for b in blocks if b.skip is None for c in b.commands for p in parts(c)]
    assert sum(msa_train_overrides(p) is not None for p in runnable) >= 5


def test_setup_commands_are_what_ci_runs():
    """The first block is the setup: the install line and the test command of .ci/run."""
    first = _blocks()[0]
    assert first.skip is None
    install, *rest = parts(first.commands[0])
    assert install == _ci_line("pip install"), "README's install line differs from .ci/run's"
    assert rest == [["msa-train"]]
    assert parts(first.commands[1]) == [_ci_line("python -m pytest")]


def _compose(overrides):
    from msa_train.cli import compose

    return compose(overrides)


def test_every_msa_train_command_composes():
    """Every msa-train command of the README, run or not, is a valid configuration."""
    seen = 0
    for block in _blocks():
        for command in block.commands:
            for argv in parts(command):
                overrides = msa_train_overrides(argv)
                if overrides is None or {"--help", "--cfg"} & set(overrides):
                    continue
                try:
                    _compose(overrides)
                except Exception as e:  # noqa: BLE001 - the message says which command
                    raise AssertionError(f"README line {block.line}: {command!r} does not compose: {e}") from e
                seen += 1
    assert seen


def _check_sequence(blocks: list[Block], exists=lambda p: (ROOT / p).exists()) -> list[str]:
    """What would go wrong running the runnable commands in order on a fresh clone, without
    running them: a fresh run over an earlier run's directory (refused), a resume that does not
    raise the step count ("nothing to train"), an evaluation of a directory without a run, a
    model.path or data.path that neither the clone nor an earlier command provides."""
    problems, runs, written = [], {}, set()
    for block in (b for b in blocks if b.skip is None):
        for command in block.commands:
            for argv in parts(command):
                where = f"README line {block.line}: {shlex.join(argv)}"
                if ">" in argv:
                    written.add(os.path.normpath(argv[argv.index(">") + 1]))
                overrides = msa_train_overrides(argv)
                if overrides is None or {"--help", "--cfg"} & set(overrides):
                    continue
                cfg = _compose(overrides)
                out = os.path.normpath(cfg.train.output_dir)
                if cfg.model.path is not None:
                    mp = os.path.normpath(cfg.model.path)
                    if not any(mp == os.path.join(r, "hf") for r in runs) and not exists(mp):
                        problems.append(f"{where}: model.path {mp} is not an earlier run's hf/ dir")
                for p in cfg.data.path or []:
                    if os.path.normpath(p) not in written and not exists(p):
                        problems.append(f"{where}: data.path {p} does not exist on a fresh clone")
                if cfg.eval.only:
                    if out not in runs or cfg.train.resume != "auto":
                        problems.append(f"{where}: eval.only needs an earlier run in {out} and train.resume=auto")
                elif cfg.train.resume == "auto":
                    if out not in runs:
                        problems.append(f"{where}: resumes {out}, which holds no run yet")
                    elif cfg.train.steps <= runs[out]:
                        problems.append(f"{where}: {out} already trained {runs[out]} steps; nothing to train")
                    runs[out] = max(runs.get(out, 0), cfg.train.steps)
                else:
                    if out in runs:
                        problems.append(f"{where}: a fresh run in {out}, which an earlier command's run holds")
                    runs[out] = cfg.train.steps
    return problems


def test_readme_commands_fit_together():
    assert _check_sequence(_blocks()) == []


def test_sequence_check_catches_collisions():
    """The check fails on the collisions a new user hit: a second fresh run in runs/tiny, and a
    resume that does not go past the steps already trained."""
    text = "```bash\nmsa-train\nmsa-train data.eval_fraction=0.05\nmsa-train train.resume=auto\n```\n"
    problems = _check_sequence(readme_blocks(text))
    assert len(problems) == 2
    assert "which an earlier command's run holds" in problems[0] and "nothing to train" in problems[1]


def _small_steps(cfg, runs: dict) -> list[str]:
    """2 steps for a fresh run; 2 more than the directory holds for a resume; none for eval.only."""
    out = os.path.normpath(cfg.train.output_dir)
    if cfg.eval.only:
        return []
    steps = runs.get(out, 0) + 2 if cfg.train.resume == "auto" else 2
    runs[out] = steps
    return [f"train.steps={steps}"]


@pytest.mark.slow
def test_readme_commands_run_in_order(tmp_path):
    """Run the README's runnable commands in order in a copy of the checkout (small sizes)."""
    work = tmp_path / "clone"
    shutil.copytree(ROOT, work, ignore=shutil.ignore_patterns(
        ".git", ".venv", "venv", "runs", "benchmarks", "__pycache__", "*.egg-info", ".pytest_cache"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # the commands' programs run this interpreter on this checkout's packages
    for name, target in {"msa-train": "-m msa_train.cli", "torchrun": "-m torch.distributed.run", "python": ""}.items():
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {target} "$@"\n')
        shim.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=os.pathsep.join([str(ROOT / "kernels"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    runs, ran = {}, 0
    for block in (b for b in _blocks() if b.skip is None):
        for command in block.commands:
            for argv in parts(command):
                if argv[:2] == ["pip", "install"] or argv[:3] == ["python", "-m", "pytest"]:
                    continue  # the setup itself: test_setup_commands_are_what_ci_runs
                overrides = msa_train_overrides(argv)
                line = shlex.join(argv)
                if ">" in argv:  # keep the redirection a redirection
                    k = argv.index(">")
                    line = f"{shlex.join(argv[:k])} > {shlex.quote(argv[k + 1])}"
                if overrides is not None:
                    line += " " + shlex.join(SMALL + _small_steps(_compose(overrides), runs))
                proc = subprocess.run(["bash", "-c", line], cwd=work, env=env, capture_output=True, text=True,
                                      timeout=600)
                assert proc.returncode == 0, (
                    f"README line {block.line}: {line}\nexit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
                ran += 1
    assert ran >= 5
    assert re.search(r'"step": 4\b', (work / "runs" / "tiny" / "metrics.jsonl").read_text())


def test_readme_is_a_front_door():
    """Short, current, no experiment diary: at most 250 lines and no commit hashes."""
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    from tests.test_results_links import HASH

    assert HASH.findall(text) == []
