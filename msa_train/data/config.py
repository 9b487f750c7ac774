"""The typed ``data`` config group.

Every field is a plain type (str, int, float, bool, Optional, List[str]) so that the
dataclass can be registered as a Hydra structured config as it is.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

FORMATS = ("generated", "pretrain", "sft", "preference", "kto", "prompts", "retrieval")
PROMPT_FORMATS = ("prompts", "retrieval")  # prompts with answers, for GRPO (msa_train/data/prompts.py)
FILE_TYPES = ("jsonl", "json", "parquet", "txt")
TEXT_SAMPLE_BY = ("document", "paragraph", "line")
LONG_PROMPT = ("truncate_left", "drop", "error")  # msa_train/data/sft.py


@dataclass
class DataConfig:
    """Where the training documents come from and how they become token sequences.

    Attributes:
        format: "generated" (built-in long-document corpus, no files), "pretrain"
            (plain documents), "sft" (prompt/response or chat-messages records,
            loss on the response / assistant turns only) or "preference"
            (prompt/chosen/rejected pairs), "kto" (unpaired prompt/completion/label examples);
            for GRPO "prompts" (prompt/answer records) or "retrieval" (prompts of the
            retrieval tasks of msa_train/quality/tasks.py over a haystack of ``path``'s
            documents, read as pretrain, or of the generated corpus when there is no path).
        path: file or directory, or a list of them. Directories are searched
            recursively for *.jsonl, *.json, *.parquet and *.txt files.
        file_type: overrides the type detected from each file's extension.
        text_field: the document field of pretrain records.
        segments_field: the alternative field of a pretrain record whose loss covers only part of
            it: a list of ``{"text": ..., "train": true|false}`` pieces, concatenated into the
            document, of which only the ``train`` ones are trained (the rest is context), e.g.
            the answers of synthetic retrieval documents (msa_train/quality/study.py).
        prompt_field / response_field: the fields of prompt/response SFT records
            (and the prompt of preference records).
        messages_field: the field of chat records: a list of {"role", "content"}.
        chosen_field / rejected_field: the two responses of a preference record.
        answer_field: the answer of a prompts record, which GRPO's reward checks.
        completion_field / label_field: an unpaired KTO record's completion and its label
            (true: desirable, false: undesirable), beside its prompt (``prompt_field``).
        tasks / num_prompts: the retrieval tasks (of msa_train/quality/tasks.py) and how many
            prompts data.format=retrieval draws (train.seq_len tokens each, answer included).
        text_sample_by: how a .txt file is cut into documents: one "document" per
            file, one per blank-line separated "paragraph", or one per "line".
        tokenizer: None (the model's tokenizer when model.path is given, else the
            built-in byte-level tokenizer), "byte" (always the built-in one), or a
            local directory holding a HF tokenizer.
        add_bos: prepend the tokenizer's BOS token (when it has one) to each document.
        max_bad_fraction: the run fails when more than this fraction of the
            records is malformed; below it the bad records are skipped with a warning.
        num_docs / min_doc_tokens / max_doc_tokens: size of the generated corpus
            (lengths are in characters, which are tokens of the byte-level tokenizer).
        seed: seeds the generated corpus and the packing order.
        eval_path: held-out evaluation files, read like ``path`` (same format, fields
            and tokenizer). Not with the generated corpus: use ``eval_fraction``.
        eval_fraction: hold out this fraction of the documents (or pairs) of ``path``,
            or of the generated corpus, for evaluation; chosen by ``seed``, and never
            trained on. At most one of ``eval_path`` and ``eval_fraction``.
        long_prompt: what becomes of an SFT record longer than ``train.seq_len``:
            "truncate_left" (its prompt loses its beginning, the response stays whole when it
            fits), "drop" or "error"; see ``msa_train/data/sft.py``. SFT only.
        num_proc: worker processes for tokenisation.
        cache_dir: where the loaded records and their tokenisation are cached.
            None keeps everything in memory and writes nothing to disk.
        allow_changed: resume a checkpoint although the data files differ from those it
            trained on (by size or the hash of their first and last MiB); by default refused.
    """

    format: str = "generated"
    path: Optional[Any] = None  # str | List[str]; Any keeps Hydra from forcing one of them
    file_type: Optional[str] = None
    text_field: str = "text"
    segments_field: str = "segments"
    prompt_field: str = "prompt"
    response_field: str = "response"
    messages_field: str = "messages"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    answer_field: str = "answer"
    completion_field: str = "completion"
    label_field: str = "label"
    tasks: List[str] = field(default_factory=lambda: ["passkey"])
    num_prompts: int = 256
    text_sample_by: str = "document"
    tokenizer: Optional[str] = None
    add_bos: bool = True
    max_bad_fraction: float = 0.0
    num_docs: int = 256
    min_doc_tokens: int = 512
    max_doc_tokens: int = 4096
    seed: int = 0
    eval_path: Optional[Any] = None  # str | List[str], like path
    eval_fraction: float = 0.0
    long_prompt: str = "truncate_left"
    num_proc: int = 1
    cache_dir: Optional[str] = None
    allow_changed: bool = False

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"data.format={self.format!r} is not one of {list(FORMATS)}")
        if self.file_type is not None and self.file_type not in FILE_TYPES:
            raise ValueError(f"data.file_type={self.file_type!r} is not one of {list(FILE_TYPES)} (or null to detect)")
        if self.text_sample_by not in TEXT_SAMPLE_BY:
            raise ValueError(f"data.text_sample_by={self.text_sample_by!r} is not one of {list(TEXT_SAMPLE_BY)}")
        self.path = _normalise_path(self.path)
        if self.format == "retrieval":
            from msa_train.quality.tasks import check_tasks

            check_tasks(list(self.tasks), "data.tasks")
            if self.num_prompts < 2:
                raise ValueError(f"data.num_prompts={self.num_prompts} must be >= 2")
            if self.eval_path:
                raise ValueError("data.eval_path does not go with data.format=retrieval: its held-out prompts are "
                                 "drawn apart (data.eval_fraction of data.num_prompts)")
        elif self.format == "generated":
            if self.path:
                raise ValueError("data.path must be empty with data.format='generated'; "
                                 f"use format in {list(FORMATS[1:])} to read files")
        self.eval_path = _normalise_path(self.eval_path, "data.eval_path")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction={self.eval_fraction} must be in [0, 1): the fraction of the "
                             "documents held out for evaluation")
        if self.eval_path and self.eval_fraction:
            raise ValueError("data.eval_path and data.eval_fraction are alternatives: evaluate on your own files, "
                             "or hold out a fraction of data.path, not both")
        if self.eval_path and self.format == "generated":
            raise ValueError("data.eval_path needs a file format (data.format in pretrain, sft, preference); with the "
                             "generated corpus hold out documents with data.eval_fraction")
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise ValueError(f"data.max_bad_fraction={self.max_bad_fraction} must be in [0, 1]")
        if self.num_docs < 1:
            raise ValueError(f"data.num_docs={self.num_docs} must be >= 1")
        if not 64 <= self.min_doc_tokens <= self.max_doc_tokens:
            raise ValueError(f"data.min_doc_tokens={self.min_doc_tokens} and data.max_doc_tokens="
                             f"{self.max_doc_tokens} must satisfy 64 <= min_doc_tokens <= max_doc_tokens")
        if self.long_prompt not in LONG_PROMPT:
            raise ValueError(f"data.long_prompt={self.long_prompt!r} is not one of {list(LONG_PROMPT)}: what becomes "
                             "of an SFT record longer than train.seq_len")
        if self.num_proc < 1:
            raise ValueError(f"data.num_proc={self.num_proc} must be >= 1")
        for name in ("text_field", "segments_field", "prompt_field", "response_field", "messages_field",
                     "chosen_field", "rejected_field", "answer_field", "completion_field", "label_field"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"data.{name} must be a non-empty string, got {getattr(self, name)!r}")

    @property
    def paths(self) -> List[str]:
        """``path`` as a list (empty for the generated corpus)."""
        return list(self.path or [])

    def require_path(self) -> None:
        """A run that reads files needs them: checked by the whole config (``RootConfig``), since a
        memory plan (``train.plan=true``) reads no data and plans a recipe without its ``data.path``."""
        if self.format not in ("generated", "retrieval") and not self.path:
            raise ValueError(f"data.path is required with data.format={self.format!r}: "
                             "a jsonl / json / parquet / txt file or directory, or a list of them")

    @property
    def has_eval(self) -> bool:
        """Whether held-out evaluation data is configured."""
        return bool(self.eval_path) or self.eval_fraction > 0


def _normalise_path(path: Any, key: str = "data.path") -> List[str]:
    """str | list[str] | None -> list[str]. Hydra hands lists over as ListConfig, hence no isinstance(list)."""
    if path is None or path == "":
        return []
    if isinstance(path, str):
        return [path]
    try:
        paths = [p for p in path]
    except TypeError:
        raise ValueError(f"{key} must be a string or a list of strings, got {type(path).__name__}") from None
    for p in paths:
        if not isinstance(p, str) or not p:
            raise ValueError(f"{key} entries must be non-empty strings, got {p!r}")
    return paths
