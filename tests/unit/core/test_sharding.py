"""Sharding plans: every sequence exactly once, the documented layout, clear errors."""

import pytest
import torch

from gradnorm.core.sharding import BUDGET_KINDS, SHARD_KINDS, budget_plan, make_plan, tokens_per_rank, validate_plan

LENGTHS = torch.tensor([5, 1, 8, 2, 7, 3, 6, 4])


def as_lists(plan):
    return [[mb.tolist() for mb in rank] for rank in plan]


@pytest.mark.parametrize("kind", SHARD_KINDS)
@pytest.mark.parametrize("world_size, accum_steps", [(1, 1), (2, 2), (4, 1), (1, 4), (2, 4)])
def test_every_plan_covers_each_sequence_once(kind, world_size, accum_steps):
    plan = make_plan(kind, LENGTHS, world_size, accum_steps)
    validate_plan(plan, len(LENGTHS))
    assert len(plan) == world_size and all(len(rank) == accum_steps for rank in plan)


def test_layouts_by_hand():
    assert as_lists(make_plan("contiguous", LENGTHS, 2, 2)) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert as_lists(make_plan("interleave", LENGTHS, 2, 2)) == [[[0, 2], [4, 6]], [[1, 3], [5, 7]]]
    # by length: 1(1) 2(3) 3(5) 4(7) | 5(0) 6(6) 7(4) 8(2)
    assert as_lists(make_plan("length", LENGTHS, 2, 2)) == [[[1, 3], [5, 7]], [[0, 6], [4, 2]]]


def test_length_sharding_gives_rank_zero_the_fewest_tokens():
    per_rank = tokens_per_rank(make_plan("length", LENGTHS, 4, 1), LENGTHS)
    assert per_rank == sorted(per_rank) and per_rank[0] < per_rank[-1]


def test_balanced_sharding_evens_out_tokens():
    lengths = torch.tensor([9, 8, 1, 1, 1, 4, 2, 2, 3, 1])
    assert tokens_per_rank(make_plan("contiguous", lengths, 2, 1), lengths) == [20, 12]
    assert tokens_per_rank(make_plan("balanced", lengths, 2, 1), lengths) == [16, 16]


def test_balanced_bins_hold_different_numbers_of_sequences():
    lengths = torch.tensor([9] + [1] * 9)
    plan = make_plan("balanced", lengths, 2, 1)
    assert tokens_per_rank(plan, lengths) == [9, 9]
    assert sorted(len(rank[0]) for rank in plan) == [1, 9]


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="cannot be split over 3 ranks x 1 microbatches"):
        make_plan("contiguous", LENGTHS, 3, 1)
    with pytest.raises(ValueError, match="unknown sharding 'sorted'"):
        make_plan("sorted", LENGTHS, 2, 1)
    with pytest.raises(ValueError, match="exactly once"):
        validate_plan([[torch.tensor([0, 0])]], 2)
    with pytest.raises(ValueError, match="same number of microbatches"):
        validate_plan([[torch.tensor([0])], [torch.tensor([1]), torch.tensor([], dtype=torch.long)]], 2,
                      equal_microbatches=True)
    validate_plan([[torch.tensor([0])], [torch.tensor([1]), torch.tensor([], dtype=torch.long)]], 2)  # a budget's


@pytest.mark.parametrize("kind", BUDGET_KINDS)
def test_a_token_budget_over_more_ranks_than_sequences_leaves_ranks_empty(kind):
    # tests/unit/core/test_plan_properties.py found this: interleave raised when W exceeded S + 1.
    plan = budget_plan(kind, torch.tensor([3]), 3, 20)
    assert [[mb.tolist() for mb in rank] for rank in plan] == [[[0]], [], []]
