import pytest
import torch

from common.errors import BadInput
from drafter.model.vocab import build_vocab_maps, validate_vocab_maps


def test_top_k_by_frequency_sorted_ascending():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    d2t, t2d = build_vocab_maps(counts, 4)
    chosen = torch.arange(4) + d2t
    assert chosen.tolist() == [0, 2, 3, 5]  # 9, 9, 7, 5 -> sorted ids
    assert t2d.tolist() == [True, False, True, True, False, True, False, False]
    validate_vocab_maps(d2t, t2d, 4, 8)


def test_pads_with_unseen_ids_when_too_few_distinct_tokens():
    counts = torch.zeros(10)
    counts[7] = 3
    counts[4] = 1
    d2t, t2d = build_vocab_maps(counts, 5)
    chosen = (torch.arange(5) + d2t).tolist()
    assert chosen == [0, 1, 2, 4, 7]  # the two seen ids + the lowest unseen ones
    validate_vocab_maps(d2t, t2d, 5, 10)


def test_invariants_hold_on_random_counts():
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        counts = torch.randint(0, 5, (200,), generator=gen)
        d2t, t2d = build_vocab_maps(counts, 37)
        validate_vocab_maps(d2t, t2d, 37, 200)
        assert int(t2d.sum()) == 37


@pytest.mark.parametrize(
    "breaker, message",
    [
        (lambda d, t: (d, torch.cat([t, t[:1]])), "t2d has shape"),
        (lambda d, t: (d[:-1], t), "d2t has shape"),
        (lambda d, t: (d, t.clone().fill_(True)), "true entries"),
        (
            lambda d, t: (d + torch.nn.functional.one_hot(torch.tensor(1), d.numel()), t),
            "disagree at draft id 1",
        ),
        (lambda d, t: (d + 1000, t), "outside the target vocab"),
    ],
)
def test_broken_maps_are_named(breaker, message):
    d2t, t2d = build_vocab_maps(torch.arange(50).flip(0), 10)
    d2t, t2d = breaker(d2t, t2d)
    with pytest.raises(BadInput, match=message):
        validate_vocab_maps(d2t, t2d, 10, 50)
