"""Every reference to a results file names one that exists, and the results tree stays the
current measurements (``benchmarks/results/<benchmark>/latest.*`` plus the files docs cite)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
REF = re.compile(r"benchmarks/results/([A-Za-z0-9_./-]*[A-Za-z0-9_/])(#[A-Za-z0-9_-]+)?")
HASH = re.compile(r"(?<![A-Za-z0-9])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![A-Za-z0-9])")


def anchors(md: str) -> set[str]:
    """GitHub's anchors of a markdown file's headings (lower case, punctuation but - and _ dropped)."""
    out = set()
    for m in re.finditer(r"^#+ (.+)$", md, flags=re.M):
        out.add(re.sub(r"[^a-z0-9 _-]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def references() -> list[tuple[str, str, str | None]]:
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    for top in ("kernels", "msa_train", "scripts", "tests"):
        files += [p for p in (ROOT / top).rglob("*") if p.suffix in (".py", ".sh", ".md")]
    out = []
    for f in files:
        text = f.read_text()
        for m in REF.finditer(text):
            end = m.end()
            if text[end:end + 1] in ("<", "*", "{") or text[end:end + 2] in (".{", ".*"):  # a pattern, not a file
                continue
            out.append((str(f.relative_to(ROOT)), m.group(1).rstrip("."), (m.group(2) or "")[1:] or None))
    return out


def test_every_results_reference_exists():
    missing = []
    for where, rel, anchor in references():
        target = RESULTS / rel
        if not target.exists():
            missing.append(f"{where}: benchmarks/results/{rel}")
        elif anchor and anchor not in anchors(target.read_text()):
            missing.append(f"{where}: benchmarks/results/{rel}#{anchor} (no such section)")
    assert missing == []


def test_anchor_rule():
    assert anchors("# A title\n## selected_variants5\n### Run (G=4), at 64K\n") == {
        "a-title", "selected_variants5", "run-g4-at-64k"}


def test_results_tree_is_current_and_small():
    files = [p.relative_to(RESULTS) for p in RESULTS.rglob("*") if p.is_file()]
    assert len(files) <= 80, f"{len(files)} files under benchmarks/results: superseded results leave the tree"
    assert [f for f in files if len(f.parts) == 1] == [], "results live in benchmarks/results/<benchmark>/"
    assert [str(f) for f in files if HASH.search(str(f))] == [], "results are named by what they are, not by commit"
    # a benchmark's current run is latest.*; these hold one-off records that docs cite instead
    records = {"ncu", "probes", "eval", "sp", "profile_step", "quality"}  # quality: summary.json (issue 44)
    for bench in {f.parts[0] for f in files} - records:
        assert any(f.parts[0] == bench and f.stem == "latest" for f in files), f"{bench}/ has no latest.*"


def test_scripts_are_only_the_maintained_tools():
    assert len([p for p in (ROOT / "scripts").iterdir() if p.is_file()]) <= 12


def test_markdown_links_of_readme_and_docs_resolve():
    broken = []
    for f in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)\s]+)\)", f.read_text()):
            path, _, anchor = target.partition("#")
            if re.match(r"[a-z]+:", path) or not path:
                continue
            resolved = (f.parent / path).resolve()
            if not resolved.exists():
                broken.append(f"{f.relative_to(ROOT)}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
                broken.append(f"{f.relative_to(ROOT)}: {target} (no such section)")
    assert broken == []
