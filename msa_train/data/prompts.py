"""Prompts with answers, GRPO's data (``data.format=prompts`` or ``retrieval``; docs/data.md#prompts-for-grpo).

- ``prompts``: records of ``data.path`` with a prompt (``data.prompt_field``) and the answer its
  reward checks (``data.answer_field``). A prompt longer than ``train.seq_len`` tokens follows
  ``data.long_prompt``: ``truncate_left`` keeps its end, ``drop`` leaves it out, ``error`` refuses.
- ``retrieval``: ``data.num_prompts`` probes of the retrieval tasks (``data.tasks``, from
  msa_train/quality/tasks.py) of ``train.seq_len`` tokens each, their answer cut off: the question
  is the prompt's end. The haystack is ``data.path``'s documents read as plain text (pretrain
  records), or the generated corpus. Each probe draws its task and its needle depth; the held-out
  prompts (``data.eval_fraction``) are drawn from a seed stream of their own, so none is trained on.
"""
from __future__ import annotations

import dataclasses
import logging
import random
from typing import Any, Dict, List, Optional, Tuple

import torch
from transformers import PreTrainedTokenizerBase

from .config import DataConfig

logger = logging.getLogger(__name__)


class PromptDataset:
    """Item i: ``prompt_ids`` (int64 [P], BOS included where the data adds it) and ``answer`` (str)."""

    def __init__(self, prompts: List[List[int]], answers: List[str], report=None, what: str = "training"):
        if not prompts:
            raise ValueError(f"data: no {what} prompts are left (check data.path, data.long_prompt=drop against "
                             "train.seq_len, data.eval_fraction against data.num_prompts)")
        self.prompts, self.answers, self.report = prompts, answers, report

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Dict[str, Any]:
        return {"prompt_ids": torch.tensor(self.prompts[i], dtype=torch.int64), "answer": self.answers[i]}


def build_prompt_datasets(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, seq_len: int, train: bool = True
                          ) -> Tuple[Optional[PromptDataset], Optional[PromptDataset]]:
    """(training prompts, held-out prompts or None) of ``cfg`` (see the module doc)."""
    if cfg.format == "retrieval":
        return _retrieval_prompts(cfg, tokenizer, seq_len, train)
    from .sources import load_records, split_held_out

    records, report = load_records(cfg)
    records, held = split_held_out(records, cfg)
    if cfg.eval_path:
        held, _ = load_records(dataclasses.replace(cfg, path=cfg.eval_path, eval_path=None))
    out = []
    for recs, what, wanted in ((records, "training", train), (held, "evaluation", held is not None)):
        out.append(_tokenized(recs, cfg, tokenizer, seq_len, what, report) if wanted else None)
    return out[0], out[1]


def _tokenized(records, cfg: DataConfig, tokenizer, seq_len: int, what: str, report) -> PromptDataset:
    from .sources import column
    from .tokenization import _bos, _encode

    bos = _bos(tokenizer, cfg.add_bos)
    prompts, answers, cut, dropped = [], [], 0, 0
    for ids, answer in zip(_encode(tokenizer, column(records, "prompt")), column(records, "answer")):
        ids = bos + ids
        if len(ids) > seq_len:
            if cfg.long_prompt == "error":
                raise ValueError(f"data: a {what} prompt has {len(ids)} tokens, more than train.seq_len={seq_len} "
                                 "(data.long_prompt=error); raise train.seq_len or set data.long_prompt="
                                 "truncate_left or drop")
            if cfg.long_prompt == "drop":
                dropped += 1
                continue
            ids, cut = bos + ids[len(ids) - seq_len + len(bos):], cut + 1
        prompts.append(ids)
        answers.append(answer)
    if cut or dropped:
        logger.warning("data: %d of %d %s prompts are longer than train.seq_len=%d: %s (data.long_prompt=%s)",
                       cut + dropped, len(records), what, seq_len,
                       f"{cut} keep their end" if cut else f"{dropped} left out", cfg.long_prompt)
    logger.info("data (%s): %d prompts, up to %d tokens", what, len(prompts), max(map(len, prompts), default=0))
    return PromptDataset(prompts, answers, report, what)


def _retrieval_prompts(cfg: DataConfig, tokenizer, seq_len: int, train: bool):
    from msa_train.quality.tasks import Haystack, make_probe

    from .generated import generate_corpus
    from .sources import column, load_records
    from .tokenization import _encode

    if cfg.path:
        texts = column(load_records(dataclasses.replace(cfg, format="pretrain"))[0], "text")
    else:
        texts = generate_corpus(cfg)
    haystack = Haystack(_encode(tokenizer, texts), tokenizer)
    bos = tokenizer.bos_token_id if cfg.add_bos else None
    n_eval = max(1, round(cfg.eval_fraction * cfg.num_prompts)) if cfg.eval_fraction else 0

    def draw(count: int, stream: str) -> PromptDataset:
        prompts, answers = [], []
        rng = random.Random(f"grpo/{stream}/{cfg.seed}")
        for _ in range(count):
            task = rng.choice(list(cfg.tasks))
            try:
                p = make_probe(task, tokenizer, haystack, seq_len, rng.random(), rng, bos)
            except ValueError as e:
                raise ValueError(f"data.format=retrieval, task {task}: {str(e).split(';')[0]}; raise train.seq_len "
                                 "(a prompt is train.seq_len tokens with its answer)") from None
            prompts.append(p["input_ids"][: seq_len - p["answer_tokens"]].tolist())
            answers.append(p["answer"])
        return PromptDataset(prompts, answers, what="training" if stream == "train" else "evaluation")

    train_ds = draw(cfg.num_prompts - n_eval, "train") if train else None
    eval_ds = draw(n_eval, "eval") if n_eval else None
    logger.info("data: %d retrieval prompts (%s) of %d tokens over a haystack of %d tokens%s", cfg.num_prompts - n_eval,
                ",".join(cfg.tasks), seq_len, len(haystack.ids), f", {n_eval} held out" if n_eval else "")
    return train_ds, eval_ds

