"""Property tests (hypothesis): the simulated weights equal the longhand ones under any plan.

tests/unit/core/test_oracle.py checks a grid: two fixed batches, five layouts, the four shardings. Here
hypothesis draws the case itself: response lengths (zeros included) and prompt groups, W and A,
and a plan that is one of the four shardings, a token budget (ranks hold different numbers of
microbatches) or any ragged assignment (each sequence into any microbatch, in a drawn order, empty
microbatches allowed), for every mode. What must hold: ``simulate.effective_weights`` equals
tests/helpers/longhand.py's weights (float64, one rounding each: to 1e-15).

The profile is tests/conftest.py's: derandomized with a fixed number of examples, so a run is
deterministic and takes the same time every time. The controls: a weight function that divides by
the microbatch's tokens instead of the global count (the old bug put into `token`), and twice the
token weight, are each found by ``hypothesis.find``, and the case it shrinks to is the smallest
that shows the bug: a single response token (in a batch of one or two sequences; W A > 1 for the
first), out of up to 24 sequences of up to 12 tokens.
"""

import torch
from hypothesis import find, given, settings, strategies as st

from gradnorm.core import denominators
from gradnorm.core.denominators import mask_from_lengths
from gradnorm.core.sharding import BUDGET_KINDS, SHARD_KINDS, budget_plan, make_plan
from gradnorm.core.simulate import effective_weights
from tests.helpers.longhand import longhand_weights

MODES = ["local", "token", "sequence", "group", 37.0]
MAX_LEN = 12
PLAN_KINDS = [*SHARD_KINDS, "budget", "ragged"]


@st.composite
def cases(draw, modes=tuple(MODES)):
    """(mode, lengths, groups, plan, kind): a minibatch of 1 to 24 sequences and a plan of it."""
    mode, kind = draw(st.sampled_from(modes)), draw(st.sampled_from(PLAN_KINDS))
    # (|o_i|, group) pairs in one list: shrinking deletes a sequence whole
    sequences = draw(st.lists(st.tuples(st.integers(0, MAX_LEN), st.integers(0, 3)), min_size=1, max_size=24))
    lengths, groups = [n for n, _ in sequences], [g for _, g in sequences]
    num = len(sequences)
    if kind in SHARD_KINDS and kind != "balanced":  # W x A equal microbatches: both divide S
        world_size = draw(st.sampled_from([w for w in range(1, 5) if num % w == 0]))
        accum_steps = draw(st.sampled_from([a for a in range(1, 4) if num // world_size % a == 0]))
    else:
        world_size, accum_steps = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    t_lengths = torch.tensor(lengths)
    if kind == "budget":
        prompt_len = draw(st.integers(0, 4))
        budget = prompt_len + max(lengths) + draw(st.integers(0, 2 * MAX_LEN))  # the longest sequence fits
        plan = budget_plan(draw(st.sampled_from(BUDGET_KINDS)), t_lengths, world_size, budget, prompt_len)
    elif kind == "ragged":
        order = draw(st.permutations(range(num)))
        bins = draw(st.lists(st.integers(0, world_size * accum_steps - 1), min_size=num, max_size=num))
        plan = [[torch.tensor([i for i, b in zip(order, bins) if b == r * accum_steps + m], dtype=torch.long)
                 for m in range(accum_steps)] for r in range(world_size)]
    else:
        plan = make_plan(kind, t_lengths, world_size, accum_steps)
    return mode, lengths, groups, plan, kind


def weights_agree(case) -> bool:
    mode, lengths, groups, plan, _ = case
    mask = mask_from_lengths(torch.tensor(lengths), MAX_LEN)
    got = effective_weights(mask, torch.tensor(groups), 4, mode, plan)
    expected = torch.tensor(longhand_weights(mode, lengths, groups, plan), dtype=torch.float64).unsqueeze(-1) * mask
    return torch.allclose(got, expected, rtol=1e-15, atol=0)


@given(cases())
def test_effective_weights_equal_the_longhand_weights_under_any_plan(case):
    assert weights_agree(case), case


def drawn_cases() -> list:
    """The cases the profile draws for a test, as plain lists."""
    seen = []

    @given(cases())
    def record(case):
        mode, lengths, groups, plan, kind = case
        seen.append((mode, lengths, groups, [[mb.tolist() for mb in rank] for rank in plan], kind))

    record()
    return seen


def test_the_strategy_draws_every_plan_kind_mode_and_ragged_counts_and_the_same_ones_every_run():
    seen = drawn_cases()
    assert drawn_cases() == seen  # the profile is derandomized: CI checks the same cases every run
    assert {case[4] for case in seen} == set(PLAN_KINDS)
    assert {str(case[0]) for case in seen} == {str(m) for m in MODES}
    assert any(len({len(rank) for rank in case[3]}) > 1 for case in seen)  # ranks with different A
    assert any(0 in case[1] for case in seen) and any(sum(case[1]) == 0 for case in seen)


# ------------------------------------------------------------------ controls: shrinking finds the smallest plan


_TOKEN_WEIGHT = denominators.WEIGHT_FNS["token"]


def microbatch_count_instead_of_global(mb_mask, mb_groups, counts, world_size, accum_steps, dtype):
    # The old per-microbatch mean under the name token: 1 / (W A N[r, m]) instead of 1 / N.
    return denominators.WEIGHT_FNS["local"](mb_mask, mb_groups, counts, world_size, accum_steps, dtype)


def twice_the_token_weight(mb_mask, mb_groups, counts, world_size, accum_steps, dtype):
    return 2 * _TOKEN_WEIGHT(mb_mask, mb_groups, counts, world_size, accum_steps, dtype)


def smallest_failing(monkeypatch, wrong):
    """The case hypothesis shrinks to when the library's token weight is ``wrong``."""
    monkeypatch.setitem(denominators.WEIGHT_FNS, "token", wrong)
    return find(cases(modes=("token",)), lambda case: not weights_agree(case), settings=settings(database=None))


def test_control_a_per_microbatch_count_fails_and_shrinks_to_one_token(monkeypatch):
    # One token already shows it (1 / (W A) instead of 1) once W A > 1, which takes at most two
    # sequences under the shardings that need S divisible by W A.
    _, lengths, _, plan, _ = smallest_failing(monkeypatch, microbatch_count_instead_of_global)
    assert sum(lengths) == 1 and len(lengths) <= 2, (lengths, plan)
    assert sum(len(rank) for rank in plan) > 1, plan


def test_control_twice_the_weight_fails_and_shrinks_to_one_token(monkeypatch):
    _, lengths, _, plan, _ = smallest_failing(monkeypatch, twice_the_token_weight)
    assert lengths == [1], (lengths, plan)
