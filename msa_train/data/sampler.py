"""A shuffled, sharded, infinite sampler whose position can be saved and restored."""
from __future__ import annotations

from typing import Iterator

import torch


class ResumableSampler(torch.utils.data.Sampler[int]):
    """Item indices in a seeded order that is reshuffled every epoch, forever.

    Epoch e is ``randperm(num_items)`` seeded with ``seed + e``; rank r takes every
    ``world_size``-th index of it from offset r, cut to ``num_items // world_size`` so
    that all ranks have the same number of items per epoch and the shards are disjoint.
    The sampler counts the indices it has handed out; ``state_dict()`` /
    ``load_state_dict()`` save and restore that count, so a resumed sampler continues
    with exactly the next index.

    With a ``DataLoader`` the count includes indices taken ahead by worker prefetching:
    save the state with ``num_workers=0``, or set ``position`` from the number of items
    the trainer actually consumed (``load_state_dict({..., "position": n})``).

    Args:
        num_items: length of the dataset.
        seed: base seed of the shuffles.
        rank, world_size: this process's data-parallel shard.
    """

    def __init__(self, num_items: int, seed: int, rank: int = 0, world_size: int = 1):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"ResumableSampler: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if num_items < world_size:
            raise ValueError(f"ResumableSampler: num_items={num_items} packed sequences cannot feed "
                             f"world_size={world_size} ranks; add data or lower the sequence length")
        self.num_items, self.seed, self.rank, self.world_size = num_items, seed, rank, world_size
        self.items_per_epoch = num_items // world_size
        self.position = 0  # indices handed out by this rank since epoch 0

    @property
    def epoch(self) -> int:
        return self.position // self.items_per_epoch

    def _epoch_indices(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed + epoch)
        perm = torch.randperm(self.num_items, generator=g)
        return perm[self.rank::self.world_size][: self.items_per_epoch].tolist()

    def __iter__(self) -> Iterator[int]:
        while True:
            epoch, offset = divmod(self.position, self.items_per_epoch)
            for index in self._epoch_indices(epoch)[offset:]:
                self.position += 1
                yield index

    def state_dict(self) -> dict:
        return {"num_items": self.num_items, "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        """Restores the position; the data, seed and sharding must be those it was saved with."""
        for key in ("num_items", "seed", "rank", "world_size"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"ResumableSampler.load_state_dict: saved {key}={state[key]} but this sampler has "
                                 f"{key}={getattr(self, key)}; resuming exactly needs the same data and ranks")
        if int(state["position"]) < 0:
            raise ValueError(f"ResumableSampler.load_state_dict: position={state['position']} must be >= 0")
        self.position = int(state["position"])
