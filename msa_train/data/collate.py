"""Stacking packed items into a micro-batch."""
from __future__ import annotations

import torch

_TOKEN_KEYS = ("input_ids", "labels", "position_ids")


def collate_packed(items: list[dict]) -> dict:
    """Packed items -> one micro-batch.

    Args:
        items: B items of ``build_packed_dataset``, all of the same length T.

    Returns:
        ``input_ids``, ``labels``, ``position_ids``: int64 [B, T].
        ``cu_seqlens``: int32 [N+1] over the flattened stream of B*T tokens (the
        FlashAttention varlen convention): each item's boundaries offset by b*T and
        concatenated, so ``cu_seqlens[-1] == B*T``. For B == 1 it is the item's own.
        ``max_seqlen``: Python int, the longest segment of the batch.
    """
    if not items:
        raise ValueError("collate_packed: items is empty")
    T = items[0]["input_ids"].shape[0]
    for b, item in enumerate(items):
        if item["input_ids"].shape != (T,) or int(item["cu_seqlens"][-1]) != T:
            raise ValueError(f"collate_packed: item {b} has length {tuple(item['input_ids'].shape)} "
                             f"(cu_seqlens ends at {int(item['cu_seqlens'][-1])}), expected {T} like item 0")
    batch = {k: torch.stack([item[k] for item in items]) for k in _TOKEN_KEYS}
    batch["cu_seqlens"] = torch.cat(
        [items[0]["cu_seqlens"]] + [item["cu_seqlens"][1:] + b * T for b, item in enumerate(items) if b]
    ).to(torch.int32)
    batch["max_seqlen"] = max(int(item["max_seqlen"]) for item in items)
    return batch
