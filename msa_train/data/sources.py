"""Reading and validating records from local files.

The files are read here, record by record, rather than with ``load_dataset("json")``:
the datasets json loader parses a file as a whole, so one bad line fails the entire
load without naming the line, and mixed value types inside a field fail Arrow type
inference. Reading ourselves lets every malformed record be counted and reported as
``file:line: reason``, and hands the datasets library records of one fixed schema.

Locations: ``path:LINE`` (1-based) for jsonl and txt, ``path:item N`` (0-based) for
records of a JSON array, ``path:row N`` (0-based) for parquet.
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import datasets
import numpy as np

from .config import DataConfig, FILE_TYPES

logger = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant", "tool")
SOURCE_COL, ERROR_COL = "_source", "_error"
_EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet",
               ".txt": "txt", ".text": "txt", ".md": "txt"}
_MESSAGES = datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}) \
    if hasattr(datasets, "List") else [{"role": datasets.Value("string"), "content": datasets.Value("string")}]
_SEGMENTS = datasets.List({"text": datasets.Value("string"), "train": datasets.Value("bool")}) \
    if hasattr(datasets, "List") else [{"text": datasets.Value("string"), "train": datasets.Value("bool")}]


class DataValidationError(ValueError):
    """Too many malformed records: the message lists the first few as ``file:line: reason``."""


def record_features(fmt: str) -> datasets.Features:
    """The fixed schema of validated records of one format (plus source and error columns)."""
    s = datasets.Value("string")
    cols = {
        "pretrain": {"text": s, "segments": _SEGMENTS},  # segments: [] unless the record gives its trained parts
        "generated": {"text": s},
        "sft": {"prompt": s, "response": s, "messages": _MESSAGES},
        "preference": {"prompt": s, "chosen": s, "rejected": s},
        "prompts": {"prompt": s, "answer": s},
        "kto": {"prompt": s, "completion": s, "label": datasets.Value("bool")},
    }[fmt]
    return datasets.Features({**cols, SOURCE_COL: s, ERROR_COL: s})


# --------------------------------------------------------------------------- files

def resolve_files(cfg: DataConfig) -> list[tuple[str, str]]:
    """``cfg.path`` -> sorted [(file, file_type)]. Directories are walked recursively.

    Raises:
        ValueError: a path does not exist, a file type is unknown, or no file was found.
    """
    files: list[tuple[str, str]] = []
    for path in cfg.paths:
        if os.path.isdir(path):
            found = []
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(names):
                    ext = os.path.splitext(name)[1].lower()
                    # "." and "_" files are hidden, as for Hadoop / Spark (_SUCCESS, _committed_*)
                    if not name.startswith((".", "_")) and (ext in _EXTENSIONS or cfg.file_type):
                        found.append(os.path.join(root, name))
            if not found:
                raise ValueError(f"data.path={path!r}: the directory holds no "
                                 f"{'/'.join(sorted(_EXTENSIONS))} files")
            files += [(f, _file_type(f, cfg)) for f in sorted(found)]
        elif os.path.isfile(path):
            files.append((path, _file_type(path, cfg)))
        else:
            raise ValueError(f"data.path={path!r} does not exist (a local file or directory is expected)")
    if cfg.format in ("sft", "preference", "prompts", "kto"):
        txt = [f for f, t in files if t == "txt"]
        if txt:
            raise ValueError(f"data.format={cfg.format!r} needs structured records, but {txt[0]!r} is plain "
                             "text; use jsonl / json / parquet, or data.format='pretrain'")
    return files


def _file_type(path: str, cfg: DataConfig) -> str:
    if cfg.file_type:
        return cfg.file_type
    ext = os.path.splitext(path)[1].lower()
    if ext not in _EXTENSIONS:
        raise ValueError(f"data.path: cannot tell the type of {path!r} from its extension; "
                         f"set data.file_type to one of {list(FILE_TYPES)}")
    return _EXTENSIONS[ext]


def file_fingerprints(files: list[tuple[str, str]]) -> list[tuple[str, str, int, int]]:
    """(path, type, size, mtime_ns) per file: part of the cache key, so an edited file is re-read."""
    out = []
    for path, ftype in files:
        st = os.stat(path)
        out.append((os.path.abspath(path), ftype, st.st_size, st.st_mtime_ns))
    return out


_EDGE_BYTES = 1 << 20


def data_fingerprint(cfg: DataConfig) -> list[dict]:
    """What a resume checks the data files against: per file (``data.path``, then ``data.eval_path``)
    its size and a SHA-256 of its first and last MiB. Not the mtime, which a copy changes without
    changing a byte, and not a hash of everything, which would read a corpus of terabytes at every
    start; an edit in the middle that keeps the size is what this misses."""
    import dataclasses
    import hashlib

    if cfg.format == "generated":
        return []
    files = resolve_files(cfg)
    if cfg.eval_path:
        files += resolve_files(dataclasses.replace(cfg, path=cfg.eval_path, eval_path=None))
    out = []
    for path, _ in files:
        size = os.path.getsize(path)
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            digest.update(f.read(_EDGE_BYTES))
            if size > _EDGE_BYTES:
                f.seek(max(_EDGE_BYTES, size - _EDGE_BYTES))
                digest.update(f.read())
        out.append({"path": os.path.abspath(path), "size": size, "sha256_first_last_mib": digest.hexdigest()})
    return out


# --------------------------------------------------------------------------- raw records

def _raw_records(path: str, ftype: str, cfg: DataConfig) -> Iterator[tuple[str, Any, Optional[str]]]:
    """Yields (location, raw record, parse error) for one file."""
    if ftype == "jsonl":
        yield from _jsonl_records(path)
    elif ftype == "json":
        with open(path, "rb") as f:
            raw = f.read()
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            obj = None  # not one JSON value: many .json files are JSON lines
        if isinstance(obj, list):
            for i, rec in enumerate(obj):
                yield f"{path}:item {i}", rec, None
        elif isinstance(obj, dict):
            yield f"{path}:item 0", obj, None
        else:
            yield from _jsonl_records(path)
    elif ftype == "parquet":
        import pyarrow.parquet as pq
        try:
            pf = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises several types for a corrupt file
            yield f"{path}:row 0", None, f"unreadable parquet file: {e}"
            return
        # only the configured fields (a wide table's other columns are never read); a missing one
        # is left out, so its records fail validation with the field's name
        names = pf.schema_arrow.names
        columns = [c for c in _record_fields(cfg) if c in names]
        if not columns:  # none of the fields: name the columns there are, not a row's (empty) fields
            fields = " / ".join(f"data.{k}={getattr(cfg, k)!r}" for k in _field_settings(cfg))
            yield (f"{path}:row 0", None, f"no column named as {fields}; the file's columns are: "
                   f"{', '.join(names) or 'none'} (set {' / '.join('data.' + k for k in _field_settings(cfg))} "
                   "to one of them)")
            return
        row = 0
        for batch in pf.iter_batches(batch_size=1024, columns=columns):
            for rec in batch.to_pylist():
                yield f"{path}:row {row}", rec, None
                row += 1
    elif ftype == "txt":
        yield from _txt_records(path, cfg.text_sample_by, cfg.text_field)
    else:
        raise AssertionError(ftype)


def _field_settings(cfg: DataConfig) -> list[str]:
    """The data.* settings that name the fields of ``cfg.format``."""
    return {"sft": ["messages_field", "prompt_field", "response_field"],
            "preference": ["prompt_field", "chosen_field", "rejected_field"],
            "prompts": ["prompt_field", "answer_field"],
            "kto": ["prompt_field", "completion_field", "label_field"],
            "pretrain": ["text_field", "segments_field"]}.get(cfg.format, ["text_field"])


def _record_fields(cfg: DataConfig) -> list[str]:
    """The record fields the format reads."""
    if cfg.format == "sft":
        return [cfg.messages_field, cfg.prompt_field, cfg.response_field]
    if cfg.format == "preference":
        return [cfg.prompt_field, cfg.chosen_field, cfg.rejected_field]
    if cfg.format == "prompts":
        return [cfg.prompt_field, cfg.answer_field]
    if cfg.format == "kto":
        return [cfg.prompt_field, cfg.completion_field, cfg.label_field]
    return [cfg.text_field, cfg.segments_field]


def _jsonl_records(path: str) -> Iterator[tuple[str, Any, Optional[str]]]:
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines separate nothing and hold no record
            try:
                yield f"{path}:{lineno}", json.loads(line), None
            except UnicodeDecodeError as e:
                yield f"{path}:{lineno}", None, f"not valid UTF-8 ({e.reason} at byte {e.start})"
            except json.JSONDecodeError as e:
                yield f"{path}:{lineno}", None, f"invalid JSON ({e.msg} at column {e.colno})"


def _txt_records(path: str, sample_by: str, text_field: str) -> Iterator[tuple[str, Any, Optional[str]]]:
    """A text file's records: the whole file (``document``), or its non-blank lines or blank-line
    separated paragraphs, read line by line (a large file of lines or paragraphs is never held whole)."""
    lineno = 0
    try:
        with open(path, encoding="utf-8") as f:  # universal newlines: CRLF files read as LF
            if sample_by == "document":
                text = f.read()
                if text.strip():  # an empty file holds no document (as blank lines hold no paragraph)
                    yield f"{path}:1", {text_field: text}, None
                return
            for lineno, text in (_lines(f) if sample_by == "line" else _paragraphs(f)):
                yield f"{path}:{lineno}", {text_field: text}, None
    except UnicodeDecodeError as e:
        yield f"{path}:{lineno + 1}", None, f"not valid UTF-8 ({e.reason} at byte {e.start} of a read block)"


def _lines(f) -> Iterator[tuple[int, str]]:
    """(line number, line) of every line that is not blank, without its newline."""
    for lineno, line in enumerate(f, start=1):
        text = line[:-1] if line.endswith("\n") else line
        if text.strip():
            yield lineno, text


_BLANK = re.compile(r"[ \t]*\n")


def _paragraphs(f) -> Iterator[tuple[int, str]]:
    """(line number of its first character, paragraph) of each paragraph: text from its first
    non-whitespace character up to the newline before the next blank line (a line of spaces and
    tabs only), or to the end of the file, where it keeps its final newline."""
    lines, first = [], 0
    for lineno, line in enumerate(f, start=1):
        if not lines:
            start = line.lstrip()
            if start:
                lines, first = [start], lineno
        elif _BLANK.fullmatch(line):
            yield first, "".join(lines)[:-1]  # up to the newline before the blank line
            lines = []
        else:
            lines.append(line)
    if lines:
        yield first, "".join(lines)


# --------------------------------------------------------------------------- validation

def _type_name(x: Any) -> str:
    return "null" if x is None else type(x).__name__


def _get_str(rec: dict, name: str, allow_empty: bool = False) -> str:
    if name not in rec:
        raise _Bad(f"missing field {name!r} (record has: {', '.join(map(str, rec)) or 'no fields'})")
    value = rec[name]
    if not isinstance(value, str):
        raise _Bad(f"field {name!r} must be a string, got {_type_name(value)}")
    if not allow_empty and not value.strip():
        raise _Bad(f"field {name!r} is empty")
    _check_unicode(value, name)
    return value


def _check_unicode(value: str, name: str) -> None:
    """JSON's \\ud800 escapes decode to lone surrogates, which no tokenizer or Arrow column can encode."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _Bad(f"field {name!r} is not valid Unicode: a lone surrogate {value[e.start]!r} at character "
                   f"{e.start}") from None


def _get_messages(rec: dict, name: str) -> list[dict]:
    msgs = rec[name]
    if not isinstance(msgs, list) or not msgs:
        raise _Bad(f"field {name!r} must be a non-empty list of {{role, content}}, got {_type_name(msgs)}")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _Bad(f"{name}[{i}] must be an object with 'role' and 'content', got {_type_name(m)}")
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise _Bad(f"{name}[{i}].role must be one of {list(CHAT_ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise _Bad(f"{name}[{i}].content must be a string, got {_type_name(content)}")
        _check_unicode(content, f"{name}[{i}].content")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" and m["content"].strip() for m in out):
        raise _Bad(f"field {name!r} has no non-empty assistant message, so nothing would be trained")
    return out


def _get_segments(rec: dict, name: str) -> list[dict]:
    """A pretrain record's ``[{"text": str, "train": bool}, ...]``, with some non-empty text to train."""
    segs = rec[name]
    if not isinstance(segs, list) or not segs:
        raise _Bad(f"field {name!r} must be a non-empty list of {{text, train}}, got {_type_name(segs)}")
    out = []
    for i, x in enumerate(segs):
        if not isinstance(x, dict):
            raise _Bad(f"{name}[{i}] must be an object with 'text' (a string) and 'train' (true or false), got "
                       f"{_type_name(x)}")
        # a key with a null value is absent: a parquet struct column has every field any row has
        extra = sorted(k for k, v in x.items() if k not in ("text", "train") and v is not None)
        missing = [k for k in ("text", "train") if k not in x]
        if extra or missing:
            raise _Bad(f"{name}[{i}] must be an object with 'text' (a string) and 'train' (true or false)"
                       + (f"; it lacks {missing}" if missing else "") + (f"; unknown keys {extra}" if extra else ""))
        if not isinstance(x["text"], str):
            raise _Bad(f"{name}[{i}].text must be a string, got {_type_name(x['text'])}")
        if not isinstance(x["train"], bool):
            raise _Bad(f"{name}[{i}].train must be true or false, got {x['train']!r}")
        _check_unicode(x["text"], f"{name}[{i}].text")
        out.append({"text": x["text"], "train": x["train"]})
    if not "".join(x["text"] for x in out).strip():
        raise _Bad(f"field {name!r} holds no text")
    if not any(x["train"] and x["text"].strip() for x in out):
        raise _Bad(f"field {name!r} has no non-empty segment with train true, so nothing would be trained")
    return out


class _Bad(Exception):
    """A record-level validation failure; its message is the reported reason."""


def validate_record(rec: Any, cfg: DataConfig) -> dict:
    """One raw record -> the normalised columns of ``record_features(cfg.format)``.

    Raises:
        _Bad: with the reason, when the record is malformed.
    """
    if not isinstance(rec, dict):
        raise _Bad(f"expected a JSON object, got {_type_name(rec)}")
    fmt = cfg.format
    if fmt == "pretrain":
        # an empty value of the other field counts as absent: a table of both kinds (parquet, pandas)
        # holds null, "" or [] there
        text, segs = rec.get(cfg.text_field), rec.get(cfg.segments_field)
        if segs not in (None, []) and text not in (None, ""):
            raise _Bad(f"has both {cfg.text_field!r} (a document trained whole) and {cfg.segments_field!r} (a "
                       "document trained on its segments with train true): give one")
        if segs not in (None, []) or (segs == [] and text is None):
            segments = _get_segments(rec, cfg.segments_field)
            return {"text": "".join(x["text"] for x in segments), "segments": segments}
        if text is None and cfg.text_field not in rec:
            raise _Bad(f"missing field {cfg.text_field!r} (or {cfg.segments_field!r}: [{{text, train}}, ...]) "
                       f"(record has: {', '.join(map(str, rec)) or 'no fields'})")
        return {"text": _get_str(rec, cfg.text_field), "segments": []}
    if fmt == "sft":
        # a null messages field (a table mixing chat and prompt/response rows) is no chat record
        if rec.get(cfg.messages_field) is not None:
            return {"prompt": "", "response": "", "messages": _get_messages(rec, cfg.messages_field)}
        if cfg.prompt_field not in rec and cfg.response_field not in rec:
            raise _Bad(f"missing fields: either {cfg.messages_field!r} (chat) or {cfg.prompt_field!r} and "
                       f"{cfg.response_field!r} (record has: {', '.join(map(str, rec)) or 'no fields'})")
        return {"prompt": _get_str(rec, cfg.prompt_field, allow_empty=True),
                "response": _get_str(rec, cfg.response_field), "messages": []}
    if fmt == "preference":
        return {"prompt": _get_str(rec, cfg.prompt_field, allow_empty=True),
                "chosen": _get_str(rec, cfg.chosen_field), "rejected": _get_str(rec, cfg.rejected_field)}
    if fmt == "prompts":
        return {"prompt": _get_str(rec, cfg.prompt_field), "answer": _get_str(rec, cfg.answer_field)}
    if fmt == "kto":
        label = rec.get(cfg.label_field, "missing")
        if not isinstance(label, bool):
            raise _Bad(f"field {cfg.label_field!r} must be true (a desirable completion) or false (undesirable), got "
                       + ("nothing (missing field)" if label == "missing" else f"{label!r}"))
        return {"prompt": _get_str(rec, cfg.prompt_field, allow_empty=True),
                "completion": _get_str(rec, cfg.completion_field), "label": label}
    raise AssertionError(fmt)


def _empty_record(fmt: str) -> dict:
    return {"text": "", "segments": []} if fmt == "pretrain" else {"text": ""} if fmt == "generated" else \
        {"prompt": "", "response": "", "messages": []} if fmt == "sft" else \
        {"prompt": "", "answer": ""} if fmt == "prompts" else \
        {"prompt": "", "completion": "", "label": False} if fmt == "kto" else \
        {"prompt": "", "chosen": "", "rejected": ""}


def _validated_records(files: list, cfg_dict: dict) -> Iterator[dict]:
    """Every record of ``files``, valid or not; bad ones carry their reason in ``_error``.

    Bad records stay in the dataset (with empty fields) rather than being dropped here,
    so a dataset reloaded from the cache still reports them.
    """
    cfg = DataConfig(**cfg_dict)
    for path, ftype, *_ in files:
        for loc, rec, error in _raw_records(path, ftype, cfg):
            if error is None:
                try:
                    valid = validate_record(rec, cfg)
                    _warn_if_huge(valid, loc)
                    yield {**valid, SOURCE_COL: loc, ERROR_COL: ""}
                    continue
                except _Bad as e:
                    error = str(e)
            yield {**_empty_record(cfg.format), SOURCE_COL: loc, ERROR_COL: error}


HUGE_TEXT_CHARS = 10_000_000  # about 2.5M tokens: a record past this gets a warning


def _warn_if_huge(record: dict, loc: str) -> None:
    """Warn about a record whose text is larger than :data:`HUGE_TEXT_CHARS`: it loads and trains
    (tokenized in pieces of bounded memory, msa_train.data.tokenization), but slowly, and it is one
    document that packing splits over many sequences; often it is a file that was meant to be split
    (``data.text_sample_by=paragraph`` or ``line`` for text files)."""
    chars = sum(len(v) for v in record.values() if isinstance(v, str))
    if chars > HUGE_TEXT_CHARS:
        logger.warning("data: %s: a record of %.1fM characters (about %.1fM tokens); it trains as one document "
                       "split over many sequences. If it holds many documents, split it (for text files: "
                       "data.text_sample_by=paragraph or line)", loc, chars / 1e6, chars / 4e6)


# --------------------------------------------------------------------------- report

@dataclass
class RecordReport:
    """How many records were read and which were malformed (first ``MAX_EXAMPLES`` kept)."""

    total: int = 0
    num_bad: int = 0
    examples: list[str] = field(default_factory=list)  # "file:line: reason"

    MAX_EXAMPLES = 20

    @property
    def bad_fraction(self) -> float:
        return self.num_bad / self.total if self.total else 0.0

    def summary(self, shown: int = 5) -> str:
        lines = [f"{self.num_bad} of {self.total} records ({100 * self.bad_fraction:.2f}%) are malformed"]
        lines += [f"  {e}" for e in self.examples[:shown]]
        if self.num_bad > shown:
            lines.append(f"  ... and {self.num_bad - shown} more")
        return "\n".join(lines)


# The data group whose records have these fields (their default names), for the error of a file whose
# every record is malformed: the usual cause is the wrong group (SFT records under data=preference)
FIELDS_OF_GROUP = (({"prompt", "chosen", "rejected"}, "preference", "preference"),
                   ({"prompt", "completion", "label"}, "kto", "kto"),
                   ({"prompt", "response"}, "sft", "sft"), ({"messages"}, "sft", "sft"),
                   ({"prompt", "answer"}, "prompts", "prompts"), ({"text"}, "jsonl", "pretrain"),
                   ({"segments"}, "jsonl", "pretrain"))


def group_hint(files: list, cfg: DataConfig) -> str:
    """`` The records' fields (...) are those of data=GROUP.`` when the first record of ``files`` has
    the fields of another format's group than ``cfg.format``, else ``""``."""
    for path, ftype, *_ in files[:1]:
        for _, rec, error in _raw_records(path, ftype, cfg):
            if error is not None or not isinstance(rec, dict):
                return ""
            for fields, group, fmt in FIELDS_OF_GROUP:
                if fields <= rec.keys():
                    return (f" The records' fields ({', '.join(sorted(rec))}) are those of data={group}."
                            if fmt != cfg.format else "")
            return ""
    return ""


def check_report(report: RecordReport, max_bad_fraction: float, files: Optional[list] = None,
                 hint: Callable[[], str] = str) -> None:
    """Fail above the threshold, warn below it (``hint``: called only when every record is bad, its
    text added to the error: :func:`group_hint`, which reads the first file again).

    Raises:
        DataValidationError: no valid record, or a bad fraction above ``max_bad_fraction``.
    """
    if report.total == 0:
        names = [f[0] for f in files or []]
        where = (f"{names[0]} holds" if len(names) == 1 else
                 f"the {len(names)} files ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) hold") \
            if names else "the files hold"
        raise DataValidationError(f"data: {where} no records (empty, or only blank lines); check data.path")
    if report.num_bad == report.total:
        raise DataValidationError(f"data: {report.summary()}\nNo record is valid.{hint()} "
                                  "Choose the data group of the records (docs/data.md), or fix them.")
    if report.bad_fraction > max_bad_fraction:
        raise DataValidationError(
            f"data: {report.summary()}\nwhich is above data.max_bad_fraction={max_bad_fraction}. "
            "Fix the records, or raise data.max_bad_fraction to skip them.")
    if report.num_bad:
        logger.warning("data: skipping malformed records: %s", report.summary())


def load_records(cfg: DataConfig) -> tuple[datasets.Dataset, RecordReport]:
    """Reads and validates ``cfg.path``: the valid records as a Dataset, and the report.

    With ``cfg.cache_dir`` the records are written there by ``Dataset.from_generator``
    (keyed by the files' size and mtime), otherwise they are kept in memory.

    Raises:
        ValueError: bad paths; DataValidationError: too many malformed records.
    """
    files = file_fingerprints(resolve_files(cfg))
    features = record_features(cfg.format)
    gen_kwargs = {"files": files, "cfg_dict": _validation_fields(cfg)}
    if cfg.cache_dir:
        ds = datasets.Dataset.from_generator(_validated_records, features=features, gen_kwargs=gen_kwargs,
                                             cache_dir=cfg.cache_dir)
    else:
        rows = list(_validated_records(**gen_kwargs))
        ds = datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in features}, features=features)

    errors = column(ds, ERROR_COL)
    bad = [i for i, e in enumerate(errors) if e]
    report = RecordReport(total=len(ds), num_bad=len(bad))
    if bad:
        sources = column(ds.select(bad[:RecordReport.MAX_EXAMPLES]), SOURCE_COL)
        report.examples = [f"{s}: {errors[i]}" for s, i in zip(sources, bad)]
    check_report(report, cfg.max_bad_fraction, files, hint=lambda: group_hint(files, cfg))
    if bad:
        bad_set = set(bad)
        ds = ds.select([i for i in range(len(ds)) if i not in bad_set])
    return ds, report


def column(ds: datasets.Dataset, name: str, numpy: bool = False) -> Any:
    """One whole column as a list (or numpy array). ``ds[name]`` is a lazy Column in datasets >= 4."""
    sub = ds.select_columns([name])
    return (sub.with_format("numpy") if numpy else sub)[:][name]


def _validation_fields(cfg: DataConfig) -> dict:
    """The config fields that decide how records are read: the cache key of ``load_records``."""
    keys = ("format", "path", "file_type", "text_field", "segments_field", "prompt_field", "response_field",
            "messages_field", "chosen_field", "rejected_field", "answer_field", "completion_field", "label_field",
            "text_sample_by")
    return {k: getattr(cfg, k) for k in keys}


def split_held_out(records: datasets.Dataset, cfg: DataConfig):
    """(records to train on, records held out) by ``cfg.eval_fraction``: a seeded choice of whole
    records from its own stream of ``cfg.seed`` (the packing uses the seed itself); None held out
    without a fraction."""
    if not cfg.eval_fraction:
        return records, None
    n = len(records)
    n_eval = max(1, round(cfg.eval_fraction * n))
    if n_eval >= n:
        raise ValueError(f"data.eval_fraction={cfg.eval_fraction} holds out {n_eval} of the {n} documents: "
                         "none would be left to train on; lower it or add data")
    held = np.sort(np.random.default_rng([cfg.seed, 1]).permutation(n)[:n_eval])
    keep = np.setdiff1d(np.arange(n), held)
    logger.info("data: %d of %d documents held out for evaluation (data.eval_fraction=%g)", n_eval, n,
                cfg.eval_fraction)
    return records.select(keep), records.select(held)
