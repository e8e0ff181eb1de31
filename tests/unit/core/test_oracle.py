"""The simulation against loss weights written out longhand, for every mode, W, A and sharding.

``simulate.effective_weights`` (each token's weight in J under a plan) and
``simulate.simulated_gradient`` (the step of W simulated ranks with A microbatches) feed the
notebooks, the figures and the widgets. Comparing the simulation with itself at W = A = 1 cannot
catch a weight that is wrong everywhere in the same way (2/N instead of 1/N); here the reference
is tests/helpers/longhand.py, loops over integers that never call gradnorm's weight functions.

What must hold, for local, token, sequence, group and a constant C, (W, A) in (1, 1), (1, 2),
(2, 1), (2, 2), (4, 2), every sharding, and two batches (one with an empty prompt group and
sequences without tokens, one where every sequence has tokens):
- the effective weights equal the longhand ones (float64, one rounding each: to 1e-15);
- the simulated gradient equals the gradient of the longhand objective (float64: to 1e-10);
- the controls: 2/N put into the library instead of 1/N is rejected by both comparisons, also at
  W = A = 1, and counting every sequence (S) instead of those with a token (S_tok) in the
  sequence mode is rejected on the batch that has empty sequences.
"""

import pytest
import torch

from gradnorm.core import denominators
from gradnorm.core.sharding import SHARD_KINDS, make_plan
from gradnorm.core.simulate import effective_weights, simulated_gradient
from gradnorm.teach.toy import DEFAULT_LENGTHS, make_policy, make_problem, token_losses
from tests.helpers.longhand import longhand_weights

MODES = ["local", "token", "sequence", "group", 37.0]
LAYOUTS = [(1, 1), (1, 2), (2, 1), (2, 2), (4, 2)]  # (W, A)
BATCHES = {"empty-group": DEFAULT_LENGTHS, "all-nonempty": (3, 1, 12, 7, 2, 2, 9, 11, 5, 1, 4, 12, 6, 8, 10, 1)}
CASES = [(batch, mode, w, a, shard) for batch in BATCHES for mode in MODES for w, a in LAYOUTS for shard in SHARD_KINDS]


def case_id(case):
    batch, mode, w, a, shard = case
    return f"{batch}-{mode}-W{w}A{a}-{shard}"


def setup(batch, world_size, accum_steps, shard):
    problem = make_problem(lengths=BATCHES[batch])
    return problem, make_plan(shard, problem.lengths, world_size, accum_steps)


def oracle_token_weights(problem, mode, plan) -> torch.Tensor:
    """(S, T): the longhand w_i on every response token of sequence i."""
    w = longhand_weights(mode, problem.lengths.tolist(), problem.group_ids.tolist(), plan)
    return torch.tensor(w, dtype=torch.float64).unsqueeze(-1) * problem.mask


def weights_match(got, expected) -> bool:
    return torch.allclose(got, expected, rtol=1e-15, atol=0)


def simulated(problem, mode, plan) -> torch.Tensor:
    policy = make_policy(0)
    grads = simulated_gradient(lambda idx: token_losses(policy, problem, idx).loss, list(policy.parameters()),
                               problem.mask, problem.group_ids, problem.num_groups, mode, plan)
    return torch.cat([g.reshape(-1) for g in grads])


def oracle_gradient(problem, mode, plan) -> torch.Tensor:
    """The gradient of J = sum w l M over the whole batch in one pass, with the longhand weights."""
    policy = make_policy(0)
    if not problem.mask.any():
        return torch.zeros(sum(p.numel() for p in policy.parameters()), dtype=torch.float64)
    loss = token_losses(policy, problem, torch.arange(len(problem.mask))).loss
    objective = (oracle_token_weights(problem, mode, plan) * torch.where(problem.mask, loss, 0.0)).sum()
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(objective, list(policy.parameters()))])


def gradients_match(got, expected) -> bool:
    return torch.allclose(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_effective_weights_equal_the_longhand_weights(case):
    batch, mode, world_size, accum_steps, shard = case
    problem, plan = setup(batch, world_size, accum_steps, shard)
    got = effective_weights(problem.mask, problem.group_ids, problem.num_groups, mode, plan)
    expected = oracle_token_weights(problem, mode, plan)
    assert weights_match(got, expected), (got - expected).abs().max()


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_the_simulated_gradient_equals_the_gradient_of_the_longhand_objective(case):
    batch, mode, world_size, accum_steps, shard = case
    problem, plan = setup(batch, world_size, accum_steps, shard)
    got, expected = simulated(problem, mode, plan), oracle_gradient(problem, mode, plan)
    assert gradients_match(got, expected), (got - expected).norm() / expected.norm()


def test_the_batches_are_what_the_controls_need():
    empty, full = make_problem(lengths=BATCHES["empty-group"]), make_problem(lengths=BATCHES["all-nonempty"])
    assert (empty.lengths == 0).sum() == 4 and (full.lengths > 0).all()
    plan = make_plan("length", full.lengths, 2, 2)
    per_mb = [int(full.lengths[mb].sum()) for rank in plan for mb in rank]
    assert max(per_mb) > 3 * min(per_mb), per_mb  # local really is far from token under length sharding


# ------------------------------------------------------------------ controls: wrong weights are rejected


_TOKEN_WEIGHT = denominators.WEIGHT_FNS["token"]


def twice_the_token_weight(mb_mask, mb_groups, counts, world_size, accum_steps, dtype):
    return 2 * _TOKEN_WEIGHT(mb_mask, mb_groups, counts, world_size, accum_steps, dtype)


def every_sequence_counts(mb_mask, mb_groups, counts, world_size, accum_steps, dtype):
    # S = every sequence of the batch (16 here) instead of S_tok, those with a token (12).
    seq_tokens = mb_mask.sum(-1, keepdim=True).to(torch.int64)
    return denominators._weight(mb_mask, 16 * seq_tokens, dtype)


@pytest.fixture
def wrong_weights(monkeypatch):
    """Put a wrong weight function into the library's dispatch table for one test."""

    def install(mode, fn):
        monkeypatch.setitem(denominators.WEIGHT_FNS, mode, fn)

    return install


@pytest.mark.parametrize("layout", [(1, 1), (2, 2)])
def test_control_two_over_n_is_rejected_even_on_one_rank_and_one_microbatch(wrong_weights, layout):
    problem, plan = setup("all-nonempty", *layout, "length")
    expected_w, expected_g = oracle_token_weights(problem, "token", plan), oracle_gradient(problem, "token", plan)
    wrong_weights("token", twice_the_token_weight)
    w = effective_weights(problem.mask, problem.group_ids, problem.num_groups, "token", plan)
    assert torch.equal(w, 2 * expected_w)  # the bug is in place...
    assert not weights_match(w, expected_w)  # ...and both comparisons reject it
    assert not gradients_match(simulated(problem, "token", plan), expected_g)


def test_control_counting_sequences_without_tokens_is_rejected(wrong_weights):
    problem, plan = setup("empty-group", 2, 2, "interleave")
    expected_w, expected_g = oracle_token_weights(problem, "sequence", plan), oracle_gradient(problem, "sequence", plan)
    wrong_weights("sequence", every_sequence_counts)
    w = effective_weights(problem.mask, problem.group_ids, problem.num_groups, "sequence", plan)
    assert not weights_match(w, expected_w)
    assert not gradients_match(simulated(problem, "sequence", plan), expected_g)
