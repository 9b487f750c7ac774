import itertools

import pytest

from msa_train.data import ResumableSampler


def take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


@pytest.mark.parametrize("stop", [0, 7, 10, 23], ids=lambda s: f"stop{s}")
def test_resume_continues_with_the_next_item(stop):
    full = take(ResumableSampler(10, seed=3), 40)
    first = ResumableSampler(10, seed=3)
    head = take(first, stop)
    resumed = ResumableSampler(10, seed=3)
    resumed.load_state_dict(first.state_dict())
    assert head + take(resumed, 40 - stop) == full


def test_epochs_are_permutations_reshuffled():
    order = take(ResumableSampler(10, seed=0), 30)
    epochs = [order[i:i + 10] for i in (0, 10, 20)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert take(ResumableSampler(10, seed=1), 10) != epochs[0]


@pytest.mark.parametrize("num_items, world", [(12, 2), (11, 3), (8, 4)], ids=["12x2", "11x3-uneven", "8x4"])
def test_rank_shards_are_disjoint_and_equal(num_items, world):
    per_rank = num_items // world
    for epoch in range(2):
        shards = [take(ResumableSampler(num_items, seed=5, rank=r, world_size=world), per_rank * 2)
                  [epoch * per_rank:(epoch + 1) * per_rank] for r in range(world)]
        flat = [i for s in shards for i in s]
        assert len(flat) == len(set(flat)) == per_rank * world
        assert all(0 <= i < num_items for i in flat)


def test_state_mismatch_and_bad_args_raise():
    s = ResumableSampler(10, seed=0)
    with pytest.raises(ValueError, match="saved num_items=12"):
        s.load_state_dict({**s.state_dict(), "num_items": 12})
    with pytest.raises(ValueError, match="rank=2, world_size=2"):
        ResumableSampler(10, seed=0, rank=2, world_size=2)
    with pytest.raises(ValueError, match="num_items=1 packed sequences cannot feed world_size=2"):
        ResumableSampler(1, seed=0, world_size=2)


def test_works_in_a_dataloader():
    import torch
    loader = torch.utils.data.DataLoader(list(range(100, 110)), batch_size=1, sampler=ResumableSampler(10, seed=0))
    got = [int(b) for b in itertools.islice(loader, 12)]
    assert got == [100 + i for i in take(ResumableSampler(10, seed=0), 12)]
