"""A real long-document corpus and a BPE tokenizer, built from the Python packages on the machine.

``python -m msa_train.quality corpus --out DIR`` (docs/quality.md). The documents are the source
files, docs and licences of the packages in the running interpreter's site-packages, one
document per package directory (its files concatenated in sorted order, each under a header with
its path), so documents are long, real and repository-like. Whole packages are held out: no file
of a held-out package is in the training split, and a package's dist-info (licence, metadata)
goes with it. A byte-level BPE tokenizer (HF ``tokenizers``) is trained on the training split.

Written to DIR:

- ``train.jsonl``, ``heldout.jsonl``: ``{"text": ...}`` per document, what ``data.path`` reads;
- ``tokenizer/``: a ``PreTrainedTokenizerFast`` with ``<|bos|>``, ``<|eos|>``, ``<|pad|>``;
- ``manifest.json``: the interpreter, the site-packages read, the packages of each split, and the
  document, character, byte and token counts.

The build is deterministic: files in sorted order, the held-out packages and the token cap
chosen by hashes and a fixed seed, the tokenizer trained on a fixed ordered sample.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import sysconfig
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

SUFFIXES = (".py", ".pyi", ".md", ".rst", ".txt", ".cfg", ".toml")
NAMED = ("LICENSE", "LICENCE", "COPYING", "NOTICE", "METADATA", "AUTHORS", "README")
MAX_FILE_BYTES = 1 << 20          # larger files are generated tables, not prose or code
MAX_DOC_CHARS = 2_000_000         # a package directory longer than this is cut at file boundaries
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
SKIP_DIRS = {"__pycache__", ".git"}


def default_site_packages() -> List[str]:
    """The running interpreter's site-packages (purelib and platlib, once each)."""
    paths = sysconfig.get_paths()
    return sorted({paths["purelib"], paths["platlib"]})


def package_of(entry: str) -> str:
    """The package a top-level site-packages entry belongs to: ``numpy-2.1.0.dist-info`` -> ``numpy``,
    ``six.py`` -> ``six``, ``torch`` -> ``torch`` (lower case, ``-`` as ``_``)."""
    name = entry
    for suffix in (".dist-info", ".egg-info", ".py", ".pth"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            if suffix in (".dist-info", ".egg-info"):
                name = name.split("-")[0]
            break
    return name.lower().replace("-", "_").replace(".", "_")


def _wanted(path: Path) -> bool:
    return path.suffix in SUFFIXES or path.name.split(".")[0].upper() in NAMED


def _read(path: Path) -> Optional[str]:
    try:
        if path.stat().st_size > MAX_FILE_BYTES or path.is_symlink():
            return None
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return text if text.strip() else None


def scan(roots: Sequence[str]) -> Dict[str, List[str]]:
    """package -> its documents: one per directory (files directly in it, sorted), cut at file
    boundaries past ``MAX_DOC_CHARS``; a package's top-level files and dist-info join its documents."""
    groups: Dict[str, List[Tuple[str, str]]] = {}  # package -> [(directory key, file text with header)]
    for root in roots:
        root_path = Path(root)
        if not root_path.is_dir():
            raise ValueError(f"corpus: site-packages {root!r} is not a directory")
        for entry in sorted(os.listdir(root_path)):
            top = root_path / entry
            if entry.startswith((".", "_")) or entry in SKIP_DIRS:
                continue
            pkg = package_of(entry)
            if top.is_file():
                files = [top] if _wanted(top) else []
            else:
                files = []
                for dirpath, dirnames, filenames in os.walk(top):
                    dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
                    files += [Path(dirpath) / f for f in sorted(filenames) if _wanted(Path(dirpath) / f)]
            for f in files:
                text = _read(f)
                if text is not None:
                    rel = f.relative_to(root_path).as_posix()
                    groups.setdefault(pkg, []).append((str(Path(rel).parent), f"# ===== {rel} =====\n{text}\n"))
    docs: Dict[str, List[str]] = {}
    for pkg in sorted(groups):
        by_dir: Dict[str, List[str]] = {}
        for d, text in groups[pkg]:
            by_dir.setdefault(d, []).append(text)
        for d in sorted(by_dir):
            cur = ""
            for text in by_dir[d]:
                if cur and len(cur) + len(text) > MAX_DOC_CHARS:
                    docs.setdefault(pkg, []).append(cur)
                    cur = ""
                cur += text
            if cur:
                docs.setdefault(pkg, []).append(cur)
    return docs


def _hash(name: str, seed: int) -> str:
    return hashlib.sha256(f"{seed}/{name}".encode()).hexdigest()


def split_packages(sizes: Dict[str, int], heldout_fraction: float, seed: int) -> Tuple[List[str], List[str]]:
    """(train, held-out) package names: packages in hash order are held out until they hold
    ``heldout_fraction`` of the characters; a package larger than twice that target stays in
    training (holding out torch would starve it). At least one package each way."""
    if len(sizes) < 2:
        raise ValueError(f"corpus: found {len(sizes)} package(s) with text; need at least 2 to hold one out")
    target = heldout_fraction * sum(sizes.values())
    held, total = [], 0
    for name in sorted(sizes, key=lambda n: _hash(n, seed)):
        if total >= target and held:
            break
        if sizes[name] <= 2 * target or not held and name == min(sizes, key=lambda n: (sizes[n], n)):
            held.append(name)
            total += sizes[name]
    if not held:
        held = [min(sizes, key=lambda n: (sizes[n], n))]
    train = sorted(n for n in sizes if n not in held)
    return train, sorted(held)


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE (HF tokenizers) as a transformers ``PreTrainedTokenizerFast`` with bos/eos/pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    bos, eos, pad = SPECIAL_TOKENS
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad)
    wrapped.model_max_length = 1 << 30  # documents are long by design; packing cuts them
    return wrapped


def write_jsonl(path: Path, records: Iterable[dict]) -> None:
    """``records`` as JSON lines at ``path``, written whole or not at all (a temporary file, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build_corpus(out: str, site_packages: Optional[Sequence[str]] = None, max_tokens: Optional[int] = None,
                 vocab_size: int = 16384, heldout_fraction: float = 0.05, seed: int = 0,
                 tokenizer_chars: int = 50_000_000) -> Dict:
    """Build the corpus and tokenizer under ``out`` (see the module doc). Returns the manifest.

    Args:
        out: the output directory (created).
        site_packages: directories to read; None: the running interpreter's site-packages.
        max_tokens: cap on the training split's tokens (whole documents in a seeded order, until
            within 0.5% of the cap); None: all.
        vocab_size: BPE vocabulary, special tokens included.
        heldout_fraction: characters of the held-out packages, as a fraction of all.
        seed: the held-out choice, the capped subset and the tokenizer's training sample.
        tokenizer_chars: characters of training documents the tokenizer learns from.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"corpus --vocab {vocab_size}: a byte-level BPE needs at least {256 + len(SPECIAL_TOKENS)}")
    roots = list(site_packages) if site_packages else default_site_packages()
    docs = scan(roots)
    sizes = {p: sum(len(d) for d in ds) for p, ds in docs.items()}
    train_pkgs, held_pkgs = split_packages(sizes, heldout_fraction, seed)
    train_docs = [d for p in train_pkgs for d in docs[p]]
    held_docs = [d for p in held_pkgs for d in docs[p]]

    rng = random.Random(f"corpus/{seed}")
    sample_order = list(range(len(train_docs)))
    rng.shuffle(sample_order)
    sample, chars = [], 0
    for i in sample_order:
        if chars >= tokenizer_chars:
            break
        sample.append(train_docs[i])
        chars += len(train_docs[i])
    tokenizer = train_tokenizer(sample, vocab_size)

    def count(texts: Sequence[str]) -> List[int]:
        return [len(e.ids) for e in tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    if max_tokens is None:
        train_tokens = count(train_docs)
    else:
        # Documents in the seeded order until within 0.5% of the cap, tokenized a chunk at a time:
        # counting all of site-packages (GBs of text on the GPU image) to keep 20M tokens took most
        # of the build. A document that would overflow the cap is passed over for later, smaller ones.
        keep, tokens, total = [], {}, 0
        for start in range(0, len(sample_order), 64):
            if total >= 0.995 * max_tokens:
                break
            chunk = sample_order[start:start + 64]
            for i, n in zip(chunk, count([train_docs[i] for i in chunk])):
                if total + n > max_tokens and keep:
                    continue
                keep.append(i)
                tokens[i] = n
                total += n
        keep.sort()
        train_docs, train_tokens = [train_docs[i] for i in keep], [tokens[i] for i in keep]
    held_tokens = count(held_docs)

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(out_dir / "train.jsonl", ({"text": t} for t in train_docs))
    write_jsonl(out_dir / "heldout.jsonl", ({"text": t} for t in held_docs))
    tokenizer.save_pretrained(str(out_dir / "tokenizer"))
    kept = {id(d) for d in train_docs}
    kept_pkgs = [p for p in train_pkgs if any(id(d) in kept for d in docs[p])]
    manifest = {
        "python": sys.version.split()[0], "executable": sys.executable, "site_packages": roots,
        "seed": seed, "vocab_size": len(tokenizer), "max_tokens": max_tokens, "heldout_fraction": heldout_fraction,
        "tokenizer_sample_chars": chars,
        "packages": {"train": kept_pkgs, "heldout": held_pkgs},
        "documents": {"train": len(train_docs), "heldout": len(held_docs)},
        "chars": {"train": sum(map(len, train_docs)), "heldout": sum(map(len, held_docs))},
        # without the bos / eos that packing adds to every document
        "tokens": {"train": sum(train_tokens), "heldout": sum(held_tokens),
                   "train_doc_max": max(train_tokens, default=0), "heldout_doc_max": max(held_tokens, default=0)},
        "files": {name: {"bytes": (out_dir / name).stat().st_size, "sha256": _sha256(out_dir / name)}
                  for name in ("train.jsonl", "heldout.jsonl")},
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest
