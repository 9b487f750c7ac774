"""Packing tokenised documents into fixed-length sequences.

Convention, for every item of length T:

- Documents (each ending with EOS) are placed whole into sequences. A document longer
  than T is first cut into pieces of exactly T tokens, each filling a sequence on its
  own; its remainder (< T) is placed like any short document. Every document or piece
  is one segment: ``position_ids`` restart at 0 and ``cu_seqlens`` has a boundary at
  its start, so attention never crosses it (a piece of a split document does not see
  the earlier pieces).
- Placement is best-fit decreasing over the remainders, after a seeded shuffle that
  breaks ties, so padding stays small and the result is deterministic given the seed.
- The tail of a sequence that no document fills is padding: pad token, label -100, and
  its own segment (positions from 0), so ``cu_seqlens`` always ends at T.
- Labels follow the HF convention (aligned with ``input_ids``, shifted inside the loss),
  so ``labels[s]`` is what position ``s - 1`` is trained to predict. At every segment
  start ``s`` the label is set to -100: the last token of one document (its EOS) is
  never trained to predict the first token of the next document or piece.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import datasets
import numpy as np
import torch

from .sft import fit_sft_record
from .sources import column
from .tokenization import IGNORE_INDEX


@dataclass
class PackingPlan:
    """Where each packed sequence's segments come from: sequence i holds the pieces
    ``seq_ptr[i]:seq_ptr[i+1]``, piece j being tokens ``[start[j], start[j] + length[j])``
    of document ``doc[j]``."""

    seq_ptr: np.ndarray  # int64 [S+1]
    doc: np.ndarray  # int64 [P]
    start: np.ndarray  # int64 [P]
    length: np.ndarray  # int64 [P]

    def __len__(self) -> int:
        return len(self.seq_ptr) - 1


def plan_packing(lengths: np.ndarray, seq_len: int, seed: int) -> PackingPlan:
    """Assigns documents of the given token lengths to sequences of ``seq_len`` tokens.

    Args:
        lengths: int [N], tokens per document (EOS included), all >= 1.
        seq_len: T.
        seed: shuffles the document order (ties of the best-fit and the sequence order).

    Returns:
        The plan; every token of every document is placed exactly once.
    """
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(lengths))
    sequences: list[list[tuple[int, int, int]]] = []
    rest: list[tuple[int, int, int]] = []  # (doc, start, length) of remainders < seq_len
    for d in order.tolist():
        n = int(lengths[d])
        full = n // seq_len
        sequences += [[(d, k * seq_len, seq_len)] for k in range(full)]
        if n > full * seq_len:
            rest.append((d, full * seq_len, n - full * seq_len))

    # Best-fit decreasing: longest first, each into the open sequence with the least
    # room that still fits it. `free` is sorted (room, bin).
    rest.sort(key=lambda p: -p[2])  # stable: equal lengths keep the shuffled order
    bins: list[list[tuple[int, int, int]]] = []
    free: list[tuple[int, int]] = []
    for piece in rest:
        i = bisect.bisect_left(free, (piece[2], -1))
        if i < len(free):
            room, b = free.pop(i)
        else:
            room, b = seq_len, len(bins)
            bins.append([])
        bins[b].append(piece)
        if room - piece[2] > 0:
            bisect.insort(free, (room - piece[2], b))
    sequences += bins
    sequences = [sequences[i] for i in rng.permutation(len(sequences)).tolist()]

    pieces = [p for s in sequences for p in s]
    seq_ptr = np.zeros(len(sequences) + 1, dtype=np.int64)
    np.cumsum([len(s) for s in sequences], out=seq_ptr[1:])
    arr = np.asarray(pieces, dtype=np.int64).reshape(-1, 3)
    return PackingPlan(seq_ptr=seq_ptr, doc=arr[:, 0], start=arr[:, 1], length=arr[:, 2])


def pack_segments(segments: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int) -> dict:
    """Segments of (input_ids, labels) -> one packed item (see the module docstring)."""
    input_ids = np.full(seq_len, pad_id, dtype=np.int64)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    position_ids = np.empty(seq_len, dtype=np.int64)
    cu = [0]
    for ids, lab in segments:
        s, n = cu[-1], len(ids)
        input_ids[s:s + n] = ids
        labels[s:s + n] = lab
        labels[s] = IGNORE_INDEX  # no prediction across the boundary (HF labels are shifted in the loss)
        position_ids[s:s + n] = np.arange(n)
        cu.append(s + n)
    assert cu[-1] <= seq_len, cu
    placed = cu[-1]
    if cu[-1] < seq_len:  # the padding tail is a segment of its own
        position_ids[cu[-1]:] = np.arange(seq_len - cu[-1])
        cu.append(seq_len)
    cu_seqlens = torch.tensor(cu, dtype=torch.int32)
    return {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(position_ids),
        "cu_seqlens": cu_seqlens,
        "max_seqlen": int(np.diff(cu).max()),
        "num_tokens": placed,  # the document tokens, without the padding tail
    }


class PackedDataset(torch.utils.data.Dataset):
    """Packed sequences of T tokens, built on access from the tokenised documents and a plan.

    Items: ``input_ids``, ``labels``, ``position_ids`` int64 [T]; ``cu_seqlens`` int32
    [N+1] with ``cu_seqlens[-1] == T``; ``max_seqlen`` and ``num_tokens`` (document tokens, the
    padding tail left out) Python ints.
    """

    def __init__(self, tokens: datasets.Dataset, plan: PackingPlan, seq_len: int, pad_id: int):
        self.tokens = tokens.with_format("numpy", columns=["input_ids", "labels"])
        self.plan, self.seq_len, self.pad_id = plan, seq_len, pad_id
        self.report = None  # the RecordReport of the files read, set by build_packed_dataset

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(f"item {i} out of range for {len(self)} packed sequences")
        i %= len(self)
        p = self.plan
        segments = []
        for j in range(p.seq_ptr[i], p.seq_ptr[i + 1]):
            row = self.tokens[int(p.doc[j])]
            s, n = p.start[j], p.length[j]
            segments.append((row["input_ids"][s:s + n], row["labels"][s:s + n]))
        return pack_segments(segments, self.seq_len, self.pad_id)

    @property
    def num_tokens(self) -> int:
        """Document tokens placed (padding excluded)."""
        return int(self.plan.length.sum())

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.num_tokens / max(1, len(self) * self.seq_len)


class PreferencePairDataset(torch.utils.data.Dataset):
    """One preference pair per item: segment 0 is prompt + chosen, segment 1 prompt + rejected.

    Deliberately simple packing: pairs are not packed together. A pair longer than T keeps its
    responses and the end of its prompt (``fit_pair``): DPO learns from the response tokens, and a
    pair cut from the right could keep none of them. ``num_truncated`` counts the pairs longer than
    T, ``num_prompt_cut`` those whose prompt lost its beginning, ``num_response_cut`` those whose
    responses alone did not fit and were cut from the right too. Items have the packed-item keys above.

    Args:
        bos_id: the BOS token that tokenisation put first (None without one): it stays first.
    """

    def __init__(self, tokens: datasets.Dataset, seq_len: int, pad_id: int, bos_id=None):
        self.tokens = tokens.with_format("numpy", columns=[c for c in tokens.column_names if c != "length"])
        self.seq_len, self.pad_id, self.bos_id = seq_len, pad_id, bos_id
        lengths = column(tokens, "length", numpy=True)
        long = np.flatnonzero(lengths > seq_len)
        self.num_truncated = len(long)
        self.num_prompt_cut = self.num_response_cut = 0
        for i in long.tolist():
            _, prompt_cut, response_cut = self._fit(i)
            self.num_prompt_cut += prompt_cut
            self.num_response_cut += response_cut
        self.report = None

    def __len__(self) -> int:
        return len(self.tokens)

    def _fit(self, i: int):
        row = self.tokens[i]
        return fit_pair(row["chosen_input_ids"], row["chosen_labels"], row["rejected_input_ids"],
                        row["rejected_labels"], self.seq_len, self.bos_id)

    def __getitem__(self, i: int) -> dict:
        sides, _, _ = self._fit(i)
        return pack_segments(sides, self.seq_len, self.pad_id)


class KtoExampleDataset(torch.utils.data.Dataset):
    """Unpaired KTO examples, one per item: segment 0 is prompt + completion, then the padding;
    ``desirable`` (bool) is its label. As pairs, deliberately not packed together. An example
    longer than T keeps its completion and the end of its prompt (``sft.fit_sft_record``, as an SFT record);
    ``num_truncated`` counts them. Items have the packed-item keys above, and ``desirable``."""

    def __init__(self, tokens: datasets.Dataset, seq_len: int, pad_id: int, bos_id=None):
        self.tokens = tokens.with_format("numpy", columns=["input_ids", "labels", "desirable"])
        self.seq_len, self.pad_id, self.bos_id = seq_len, pad_id, bos_id
        self.num_truncated = int((column(tokens, "length", numpy=True) > seq_len).sum())
        self.report = None

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        row = self.tokens[i]
        ids, lab = fit_sft_record(row["input_ids"], row["labels"], self.seq_len, self.bos_id)[:2]
        return {**pack_segments([(ids, lab)], self.seq_len, self.pad_id), "desirable": bool(row["desirable"])}


def fit_pair(c_ids: np.ndarray, c_lab: np.ndarray, r_ids: np.ndarray, r_lab: np.ndarray, seq_len: int,
             bos_id=None) -> tuple:
    """The two sides of a pair, cut to fit ``seq_len`` tokens together.

    A pair that fits is unchanged. Otherwise the prompt (the tokens before the first label, which
    both sides share) loses tokens from its beginning, after a leading BOS, until both sides fit
    with whole responses. Responses that do not fit even with no prompt are cut from the right,
    each side keeping at least half of the room.

    Returns:
        ([(chosen ids, labels), (rejected ids, labels)], prompt was cut, responses were cut).
    """
    if len(c_ids) + len(r_ids) <= seq_len:
        return [(c_ids, c_lab), (r_ids, r_lab)], False, False

    def prompt_len(lab):
        trained = np.flatnonzero(lab != IGNORE_INDEX)
        return int(trained[0]) if len(trained) else len(lab)

    lp = min(prompt_len(c_lab), prompt_len(r_lab))
    head = 1 if bos_id is not None and lp and c_ids[0] == bos_id else 0
    rc, rr = len(c_ids) - lp, len(r_ids) - lp
    keep_p = min(lp - head, max(0, (seq_len - rc - rr) // 2 - head))
    room = seq_len - 2 * (head + keep_p)
    keep_c = min(rc, max(room - rr, room // 2))
    keep_r = min(rr, room - keep_c)

    def side(ids, lab, keep):
        parts = (slice(0, head), slice(lp - keep_p, lp), slice(lp, lp + keep))
        return np.concatenate([ids[p] for p in parts]), np.concatenate([lab[p] for p in parts])

    return ([side(c_ids, c_lab, keep_c), side(r_ids, r_lab, keep_r)], keep_p < lp - head,
            keep_c < rc or keep_r < rr)
