"""Resume's data position: micro-batches from any point, across epochs, equal the uninterrupted
sequence's tail, and the skipped ones are never loaded (batches.micro_batches with SkipFirst)."""

import itertools

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from longft.engine.batches import SkipFirst, micro_batches


class Counted(Dataset):
    def __init__(self, n):
        self.n, self.loaded = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.loaded += 1
        return torch.tensor(i)


def _stream(n=10, micro=3, start=0):
    data = Counted(n)
    sampler = SkipFirst(DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=7))
    loader = DataLoader(data, batch_size=micro, sampler=sampler)
    return data, micro_batches(loader, sampler, start)


@pytest.mark.parametrize("start", [0, 1, 3, 4, 5, 9])  # 10 rows in batches of 3: 4 a epoch (3+3+3+1)
def test_resumed_stream_is_the_tail_of_the_uninterrupted_one(start):
    _, full = _stream()
    want = [b.tolist() for b in itertools.islice(full, start + 6)][start:]
    data, resumed = _stream(start=start)
    got = [b.tolist() for b in itertools.islice(resumed, 6)]
    assert got == want
    # only what was yielded was loaded: nothing of the skipped batches
    assert data.loaded == sum(len(b) for b in got)


def test_epochs_reshuffle_and_the_short_last_batch_stays():
    _, full = _stream()
    first, second = ([b.tolist() for b in itertools.islice(full, 4)] for _ in range(2))
    assert [len(b) for b in first] == [len(b) for b in second] == [3, 3, 3, 1]
    assert sorted(sum(first, [])) == sorted(sum(second, [])) == list(range(10))
    assert first != second  # DistributedSampler reshuffles with the epoch
