"""The denominators against hand-worked numbers, and the parser against every form users type.

The hand example: four sequences with 1, 3, 2 and 2 response tokens, in two prompt groups
{0, 1} and {2, 3}. So N = 8, S = 4, N_0 = N_1 = 4, N_groups = 2, and the weights in J are
token 1/8 each; sequence 1/(4*|o_i|) = 1/4, 1/12, 1/8, 1/8; group 1/(2*4) = 1/8; C = 10 -> 1/10.
"""

import math

import pytest
import torch
from torch.testing import assert_close

from gradnorm.core.denominators import (
    Counts,
    count_tokens,
    mask_from_lengths,
    needs_global_counts,
    parse_denominator,
    rank_weights,
    token_weights,
)

LENGTHS = torch.tensor([1, 3, 2, 2])
GROUPS = torch.tensor([0, 0, 1, 1])
MASK = torch.arange(3) < LENGTHS.unsqueeze(-1)  # (4, 3)


def counts_of(lengths=LENGTHS, groups=GROUPS, num_groups=2):
    return Counts.from_vector(count_tokens(lengths, groups, num_groups))


def weights(denominator, mask=MASK, groups=GROUPS, counts=None, world_size=1, accum_steps=1):
    counts = counts_of(mask.sum(-1), groups) if counts is None else counts
    return token_weights(mask, groups, denominator, counts, world_size=world_size,
                         accum_steps=accum_steps, dtype=torch.float64)


def expected(per_sequence):
    """Broadcast one weight per sequence over its tokens, zero off the mask."""
    return MASK.double() * torch.tensor(per_sequence, dtype=torch.float64).unsqueeze(-1)


def test_count_vector_by_hand():
    assert count_tokens(LENGTHS, GROUPS, 2).tolist() == [8, 4, 4, 4]
    c = counts_of()
    assert (c.tokens, c.sequences, c.group_tokens.tolist(), c.active_groups) == (8, 4, [4, 4], 2)


def test_counts_add_up_over_ranks():
    # Summing per-rank vectors is what the all-reduce does; it must equal counting everything.
    whole = count_tokens(LENGTHS, GROUPS, 2)
    parts = count_tokens(LENGTHS[:1], GROUPS[:1], 2) + count_tokens(LENGTHS[1:], GROUPS[1:], 2)
    assert torch.equal(whole, parts)


def test_token_weights_by_hand():
    assert_close(weights("token"), expected([1 / 8] * 4))


def test_sequence_weights_by_hand():
    assert_close(weights("sequence"), expected([1 / 4, 1 / 12, 1 / 8, 1 / 8]))


def test_group_weights_by_hand():
    assert_close(weights("group"), expected([1 / 8] * 4))


def test_group_weights_with_unequal_groups():
    # Groups {0} and {1, 2, 3}: N_0 = 1, N_1 = 7, so group 0's lone token weighs 1/2, the rest 1/14.
    groups = torch.tensor([0, 1, 1, 1])
    assert_close(weights("group", groups=groups), expected([1 / 2, 1 / 14, 1 / 14, 1 / 14]))


def test_constant_weights_by_hand():
    assert_close(weights(10.0), expected([1 / 10] * 4))


def test_local_weights_by_hand():
    # As a microbatch of its own, sequence 0 (1 token) under W=2, A=2 weighs 1/(2*2*1) = 1/4;
    # sequences 1..3 together (7 tokens) weigh 1/28 each. The one short microbatch shouts.
    w0 = weights("local", mask=MASK[:1], groups=GROUPS[:1], world_size=2, accum_steps=2)
    w1 = weights("local", mask=MASK[1:], groups=GROUPS[1:], world_size=2, accum_steps=2)
    assert_close(w0, MASK[:1].double() / 4)
    assert_close(w1, MASK[1:].double() / 28)


def test_only_local_divides_by_accumulation_steps():
    c = counts_of()
    for mode in ["token", "sequence", "group", 10.0]:
        assert_close(weights(mode, counts=c, accum_steps=1), weights(mode, counts=c, accum_steps=4))
        assert_close(weights(mode, counts=c, world_size=1), weights(mode, counts=c, world_size=4))
    # Control: local does change with A, so the loop above could have failed.
    assert not torch.allclose(weights("local", accum_steps=1), weights("local", accum_steps=4))


@pytest.mark.parametrize("mode", ["token", "sequence", "group"])
def test_weights_of_a_minibatch_sum_to_one(mode):
    # token, sequence and group are weighted means: their weights over B add up to exactly 1.
    assert_close(weights(mode).sum(), torch.tensor(1.0, dtype=torch.float64))


def test_rank_weights_undo_the_ddp_mean():
    w = weights("token")
    assert_close(rank_weights(w, 4) / 4, w)  # DDP divides by W afterwards
    assert_close(rank_weights(w, 4, "sum"), w)
    with pytest.raises(ValueError, match="grad_reduction"):
        rank_weights(w, 4, "max")


def test_zero_denominators_give_zero_not_nan():
    empty = torch.zeros(3, 5, dtype=torch.bool)
    groups = torch.tensor([0, 1, 1])
    zero_counts = Counts.from_vector(count_tokens(empty.sum(-1), groups, 2))
    for mode in ["local", "token", "sequence", "group", 7.0]:
        w = token_weights(empty, groups, mode, zero_counts, world_size=2, accum_steps=2)
        assert torch.isfinite(w).all() and (w == 0).all(), mode
    # A sequence with no tokens inside a non-empty batch: zero weight for it, finite elsewhere.
    mask = MASK.clone()
    mask[1] = False
    for mode in ["local", "token", "sequence", "group"]:
        w = weights(mode, mask=mask)
        assert torch.isfinite(w).all() and (w[1] == 0).all() and w.sum() > 0, mode


def test_empty_group_is_not_counted_in_active_groups():
    lengths = torch.tensor([0, 0, 2, 2])
    c = counts_of(lengths=lengths)
    assert (c.active_groups, c.sequences) == (1, 2)


def test_modes_that_need_counts_refuse_to_run_without_them():
    with pytest.raises(ValueError, match="global counts"):
        token_weights(MASK, GROUPS, "token", None, world_size=1, accum_steps=1)
    assert [needs_global_counts(m) for m in ["local", "token", "sequence", "group", 5.0]] == [
        False, True, True, True, False]


@pytest.mark.parametrize(
    "value, parsed",
    [("token", "token"), ("local", "local"), ("sequence", "sequence"), ("group", "group"),
     ("2048", 2048.0), ("1e3", 1000.0), (2048, 2048.0), (2048.0, 2048.0), ("0.5", 0.5)],
)
def test_parse_accepts(value, parsed):
    assert parse_denominator(value) == parsed


@pytest.mark.parametrize(
    "value", ["tokens", "", "0", "-1", "nan", "inf", "-inf", "abc", None, 0, -3, math.nan, math.inf, True, [1]]
)
def test_parse_rejects_with_a_message_naming_the_accepted_forms(value):
    with pytest.raises(ValueError) as err:
        parse_denominator(value)
    message = str(err.value)
    assert repr(value) in message and '"token"' in message and "positive finite number" in message


def test_mask_from_lengths_longhand():
    assert mask_from_lengths(LENGTHS).tolist() == [[True, False, False], [True, True, True],
                                                   [True, True, False], [True, True, False]]
    assert torch.equal(mask_from_lengths(LENGTHS), MASK)
    assert mask_from_lengths([2, 0], max_len=4).tolist() == [[True, True, False, False], [False] * 4]
    assert mask_from_lengths(torch.tensor([0, 0])).shape == (2, 1)  # at least one column, all False
