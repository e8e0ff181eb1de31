"""The simulation's per-token weights: invariant modes ignore the plan, local does not."""

import pytest
import torch
from torch.testing import assert_close

from gradnorm.teach.toy import DEFAULT_LENGTHS
from gradnorm.core.sharding import SHARD_KINDS, make_plan
from gradnorm.core.simulate import effective_weights, simulated_counts

LENGTHS = torch.tensor(DEFAULT_LENGTHS)
MASK = torch.arange(12) < LENGTHS.unsqueeze(-1)
GROUPS = torch.arange(16) // 4


def weights(mode, kind, world_size, accum_steps):
    return effective_weights(MASK, GROUPS, 4, mode, make_plan(kind, LENGTHS, world_size, accum_steps))


@pytest.mark.parametrize("mode", ["token", "sequence", "group", 50.0])
def test_invariant_modes_ignore_the_plan(mode):
    reference = weights(mode, "contiguous", 1, 1)
    for kind in SHARD_KINDS:
        for world_size, accum_steps in [(2, 1), (2, 2), (4, 1), (4, 4)]:
            assert_close(weights(mode, kind, world_size, accum_steps), reference)


def test_local_depends_on_the_plan_and_equals_token_only_on_one_microbatch():
    assert_close(weights("local", "contiguous", 1, 1), weights("token", "contiguous", 1, 1))
    skewed = weights("local", "length", 2, 2)
    assert not torch.allclose(skewed, weights("token", "length", 2, 2))
    # The shortest non-empty microbatch's tokens get the largest weight: small samples shout.
    plan = make_plan("length", LENGTHS, 2, 2)
    first_nonempty = next(mb for rank in plan for mb in rank if MASK[mb].any())
    assert skewed[first_nonempty][MASK[first_nonempty]].min() == skewed.max()


def test_simulated_counts_match_counting_everything():
    plan = make_plan("interleave", LENGTHS, 4, 2)
    c = simulated_counts(plan, LENGTHS, GROUPS, 4)
    assert (c.tokens, c.sequences, c.active_groups) == (int(LENGTHS.sum()), 12, 3)
