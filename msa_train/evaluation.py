"""What held-out evaluation measures (docs/evaluation.md); the trainer runs it (``Trainer.evaluate``).

- **Loss by position.** Long-context training is meant to make tokens far into a document
  cheaper to predict, which one mean loss hides. Every evaluated token is put in a bucket by its
  position in its document (``position_ids``: a piece of a document longer than T counts from the
  piece's start); the buckets double in width up to T: ``[0, T/2^(n-1)), ..., [T/4, T/2), [T/2, T)``.
- **Pass-key retrieval** (Mohtashami & Jaggi, 2023): a number stated once, at a chosen depth of
  T tokens of filler, asked for at the end. Scored teacher-forced, from the chunked loss's argmax
  counts, so it needs no KV cache (NSA decoding has none) and no logits beyond one loss chunk:
  a probe is retrieved when every token of the number is the model's top prediction.
"""
from __future__ import annotations

import math
import random
from typing import Any, Dict, List, Sequence, Tuple

import torch
from transformers import PreTrainedTokenizerBase

from msa_train.loss import IGNORE_INDEX

PASSKEY_DIGITS = 5
_INTRO = "A pass key is hidden somewhere in the long text below. Find it and keep it in mind.\n"
_FILLER = "The river runs on to the sea, the hills stand where they stood, and the day goes by.\n"
_NEEDLE = ("The pass key is", ". Keep it in mind: that number is the pass key.\n")
_QUESTION = "What is the pass key? The pass key is"


def position_edges(seq_len: int, buckets: int) -> List[int]:
    """``[0, T >> (n-1), ..., T >> 1, T]``: bucket b holds positions ``edges[b] <= p < edges[b+1]``."""
    if not 1 <= buckets or (1 << (buckets - 1)) > seq_len:
        raise ValueError(f"position buckets: need 1 <= buckets and 2^(buckets-1) <= seq_len, got {buckets}, {seq_len}")
    return [0] + [seq_len >> (buckets - 1 - i) for i in range(buckets)]


def position_buckets(position_ids: torch.Tensor, edges: Sequence[int]) -> torch.Tensor:
    """The bucket (int64) of every position, for ``edges`` from :func:`position_edges`."""
    inner = torch.tensor(list(edges[1:-1]), dtype=position_ids.dtype)
    return torch.bucketize(position_ids, inner, right=True)


def bucket_names(edges: Sequence[int]) -> List[str]:
    return [f"eval_loss_pos_{lo}_{hi}" for lo, hi in zip(edges[:-1], edges[1:])]


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> List[int]:
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def passkey_probes(tokenizer: PreTrainedTokenizerBase, seq_len: int, count: int, seed: int,
                   add_bos: bool = True) -> List[Dict[str, Any]]:
    """``count`` pass-key probes of exactly ``seq_len`` tokens, as packed items (one document each).

    Probe i hides a random 5-digit number at depth ``i / (count - 1)`` of the filler (0.5 for a
    single probe) and ends with the question, then the number. Only the number's tokens carry
    labels. The number is tokenised once and that same token sequence is used in the statement and
    the answer, so retrieving it is copying those tokens, whatever the tokenizer.

    Returns:
        Packed items (``input_ids``, ``labels``, ``position_ids``, ``cu_seqlens``, ``max_seqlen``),
        each with ``answer_tokens`` (how many labelled tokens) and ``depth``.

    Raises:
        ValueError: ``seq_len`` too short to hold the fixed text of a probe.
    """
    rng = random.Random(f"passkey/{seed}")
    bos = [tokenizer.bos_token_id] if add_bos and tokenizer.bos_token_id is not None else []
    intro, filler, question = _encode(tokenizer, _INTRO), _encode(tokenizer, _FILLER), _encode(tokenizer, _QUESTION)
    needle_a, needle_b = _encode(tokenizer, _NEEDLE[0]), _encode(tokenizer, _NEEDLE[1])
    items = []
    for i in range(count):
        key = _encode(tokenizer, " " + str(rng.randrange(10 ** (PASSKEY_DIGITS - 1), 10 ** PASSKEY_DIGITS)))
        needle = needle_a + key + needle_b
        fixed = len(bos) + len(intro) + len(needle) + len(question) + len(key)
        free = seq_len - fixed
        if free < 0:
            raise ValueError(f"eval.passkey: a probe's fixed text takes {fixed} tokens, more than train.seq_len="
                             f"{seq_len}; raise train.seq_len or set eval.passkey=0")
        stream = (filler * (free // max(1, len(filler)) + 1))[:free]
        depth = 0.5 if count == 1 else i / (count - 1)
        cut = round(depth * free)
        ids = bos + intro + stream[:cut] + needle + stream[cut:] + question + key
        labels = [IGNORE_INDEX] * (seq_len - len(key)) + key
        items.append({
            "input_ids": torch.tensor(ids, dtype=torch.int64),
            "labels": torch.tensor(labels, dtype=torch.int64),
            "position_ids": torch.arange(seq_len, dtype=torch.int64),
            "cu_seqlens": torch.tensor([0, seq_len], dtype=torch.int32),
            "max_seqlen": seq_len,
            "num_tokens": seq_len,
            "answer_tokens": len(key),
            "depth": depth,
        })
    return items


def lm_metrics(sums: torch.Tensor, counts: torch.Tensor, edges: Sequence[int]) -> Dict[str, Any]:
    """Host metrics from the all-reduced per-bucket ``sums`` [2, n] (loss, argmax-correct) and token ``counts`` [n]."""
    sums, counts = sums.double().cpu(), counts.double().cpu()
    n = counts.sum().item()
    loss = sums[0].sum().item() / n if n else None
    out = {"eval_loss": loss, "eval_ppl": math.exp(loss) if loss is not None and loss < 700 else None,
           "eval_token_accuracy": sums[1].sum().item() / n if n else None, "eval_tokens": int(n)}
    for name, s, c in zip(bucket_names(edges), sums[0].tolist(), counts.tolist()):
        out[name] = s / c if c else None
    return out


def _answer_scores(per_probe: torch.Tensor, need: torch.Tensor) -> Tuple[float, float, float]:
    """Over probes' host [P, >= 2] (answer loss sum, argmax-correct answer tokens, ...) and answer lengths [P]:
    exact-match accuracy, the fraction of answer tokens predicted, the loss per answer token."""
    return ((per_probe[:, 1] == need).double().mean().item(), (per_probe[:, 1].sum() / need.sum()).item(),
            (per_probe[:, 0].sum() / need.sum()).item())


def passkey_metrics(per_probe: torch.Tensor, answer_tokens: Sequence[int]) -> Dict[str, Any]:
    """Host metrics from the all-reduced per-probe [P, 2] (answer loss sum, argmax-correct answer tokens)."""
    scores = _answer_scores(per_probe.double().cpu(), torch.tensor(list(answer_tokens), dtype=torch.float64))
    return dict(zip(("eval_passkey_accuracy", "eval_passkey_token_accuracy", "eval_passkey_loss"), scores))


# ---------------------------------------------------------------- training documents (the hold-out record)
TRAINING_DOCUMENTS = "training_documents.npy"


def document_fingerprints(dataset) -> "np.ndarray":
    """uint64 [N], sorted and unique: a 64-bit BLAKE2 hash of each document's token ids, for the
    documents of a packed dataset (``PackedDataset.tokens``); None for preference pairs."""
    import hashlib

    import numpy as np

    tokens = getattr(dataset, "tokens", None)
    if tokens is None or "input_ids" not in tokens.column_names or "chosen_input_ids" in tokens.column_names:
        return None
    out = []
    for batch in tokens.iter(batch_size=256):
        for ids in batch["input_ids"]:
            digest = hashlib.blake2b(np.asarray(ids, dtype=np.int64).tobytes(), digest_size=8).digest()
            out.append(int.from_bytes(digest, "little"))
    return np.unique(np.array(out, dtype=np.uint64))


def write_training_documents(path, fingerprints, inherited=None) -> None:
    """Write the record of the documents a run trains on (atomically), with those its starting
    model was trained on (``inherited``, read from ``model.path``)."""
    import os

    import numpy as np

    if inherited is not None:
        fingerprints = np.union1d(fingerprints, inherited)
    tmp = f"{path}.tmp.npy"
    np.save(tmp, fingerprints)
    os.replace(tmp, path)


def read_training_documents(path):
    """The record at ``path`` (uint64 [N]), or None where there is none."""
    import os

    import numpy as np

    return np.load(path) if os.path.isfile(path) else None


def trained_on(eval_fingerprints, record) -> int:
    """How many of the evaluation documents are in the training record."""
    import numpy as np

    return int(np.isin(eval_fingerprints, record).sum())


# ---------------------------------------------------------------- retrieval (RULER-style, msa_train/quality/tasks.py)
def retrieval_haystack(dataset, tokenizer, max_tokens: int):
    """A :class:`~msa_train.quality.tasks.Haystack` from the documents of a packed dataset (the
    held-out documents), their bos / eos stripped, up to ``max_tokens`` tokens in dataset order."""
    from msa_train.quality.tasks import Haystack

    specials = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id} - {None}
    docs, total = [], 0
    for batch in dataset.tokens.iter(batch_size=64):
        for ids in batch["input_ids"]:
            ids = [int(t) for t in ids if int(t) not in specials]
            docs.append(ids)
            total += len(ids)
        if total >= max_tokens:
            break
    return Haystack(docs, tokenizer)


def retrieval_metrics(probes: Sequence[Dict[str, Any]], per_probe: torch.Tensor) -> Dict[str, Any]:
    """Host metrics from the all-reduced per-probe [P, 4] (answer loss sum, argmax-correct answer
    tokens, the first answer token's loss, whether it is argmax-correct): ``retrieval`` (task ->
    length -> depth -> exact-match accuracy), the mean accuracy overall and per task, and the graded
    figures that tell models apart before exact matches appear: the fraction of answer tokens that
    are the top prediction and the loss per answer token, over every answer token; the fraction of
    probes whose first answer token is the top prediction and its mean loss (``first_token_*``:
    teacher-forced, the later tokens can be copied on from the needle once the first is given, the
    first has to be found), over every probe; overall, per task, and as the mean of each probe's by
    cell (``retrieval_token_accuracy_by_cell``, ``retrieval_answer_loss_by_cell``,
    ``retrieval_first_token_accuracy_by_cell``, ``retrieval_first_token_loss_by_cell``: task -> length -> depth)."""
    from msa_train.quality.tasks import retrieval_table

    per_probe = per_probe.double().cpu()
    need = torch.tensor([p["answer_tokens"] for p in probes], dtype=torch.float64)
    if not (need > 0).all():
        raise ValueError("retrieval probes: every probe needs at least one answer token")
    if per_probe.shape != (len(probes), 4):
        raise ValueError(f"retrieval probes: expected per-probe scores of shape [{len(probes)}, 4], got {tuple(per_probe.shape)}")
    out: Dict[str, Any] = dict(zip(("eval_retrieval_accuracy", "eval_retrieval_token_accuracy", "eval_retrieval_loss"),
                                   _answer_scores(per_probe, need)))
    out["eval_retrieval_first_token_accuracy"] = per_probe[:, 3].mean().item()
    out["eval_retrieval_first_token_loss"] = per_probe[:, 2].mean().item()
    for task in dict.fromkeys(p["task"] for p in probes):
        mine = torch.tensor([p["task"] == task for p in probes])
        out.update(zip((f"eval_retrieval_{task}", f"eval_retrieval_{task}_token_accuracy", f"eval_retrieval_{task}_loss"),
                       _answer_scores(per_probe[mine], need[mine])))
        out[f"eval_retrieval_{task}_first_token_accuracy"] = per_probe[mine, 3].mean().item()
        out[f"eval_retrieval_{task}_first_token_loss"] = per_probe[mine, 2].mean().item()
    out["retrieval"] = retrieval_table(probes, (per_probe[:, 1] == need).tolist())
    out["retrieval_token_accuracy_by_cell"] = retrieval_table(probes, (per_probe[:, 1] / need).tolist())
    out["retrieval_answer_loss_by_cell"] = retrieval_table(probes, (per_probe[:, 0] / need).tolist())
    out["retrieval_first_token_accuracy_by_cell"] = retrieval_table(probes, per_probe[:, 3].tolist())
    out["retrieval_first_token_loss_by_cell"] = retrieval_table(probes, per_probe[:, 2].tolist())
    return out
