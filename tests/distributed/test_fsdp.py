"""FSDP2 (``fully_shard``) + accumulation against the same longhand full-batch oracle as DDP.

Two real gloo processes shard a policy with FSDP2 (embedding and hidden layer as their own units,
then the root) and run ``accumulate_gradients`` for A in (1, 2) under imbalanced shardings; each
rank's gradient shard is gathered with ``full_tensor``. What must hold, exactly as under DDP:

- token, sequence, group and a constant give the oracle's gradient (fp64: to 1e-10), which shows
  that FSDP2 reduces by a mean over W, the reduction ``rank_weights(w, W, "mean")`` undoes, and
  that ``set_requires_gradient_sync(False)`` really accumulates over microbatches;
- local gives its own formula and differs from the oracle (the control);
- gradnorm still adds one collective per minibatch, and an empty minibatch gives a zero gradient.
"""

import pytest
import torch
from tests.helpers.oracle import EMPTY, INVARIANT, MODES, oracle_gradient
from torch.testing import assert_close

from gradnorm.teach.harness import Case, run_ddp

pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch >= 2.6")

WORLD_SIZE = 2
CASES = [Case(mode, a, shard) for mode in MODES for a in (1, 2) for shard in ("length", "balanced")] + [
    Case(mode, 2, "contiguous", lengths=EMPTY) for mode in ("token", "local")
]


@pytest.fixture(scope="module")
def fsdp_results():
    return run_ddp(WORLD_SIZE, CASES, parallel="fsdp")


@pytest.mark.launch
def test_every_rank_gathers_the_same_gradient(fsdp_results):
    assert torch.equal(fsdp_results[0]["grads"], fsdp_results[1]["grads"])


@pytest.mark.launch
def test_fsdp_invariant_modes_match_the_full_batch_oracle(fsdp_results):
    for k, case in enumerate(CASES):
        if case.denominator in INVARIANT:
            assert_close(fsdp_results[0]["grads"][k], oracle_gradient(case, WORLD_SIZE), rtol=1e-10, atol=1e-12,
                         msg=lambda m: f"{case}: {m}")


@pytest.mark.launch
def test_fsdp_local_matches_its_formula_and_not_the_oracle(fsdp_results):
    for k, case in enumerate(CASES):
        if case.denominator != "local" or case.lengths is not None:
            continue
        got = fsdp_results[0]["grads"][k]
        assert_close(got, oracle_gradient(case, WORLD_SIZE), rtol=1e-10, atol=1e-12)
        token = oracle_gradient(Case("token", case.accum_steps, case.shard), WORLD_SIZE)
        assert (got - token).norm() / token.norm() > 1e-3, f"{case}: local should differ from the oracle"


@pytest.mark.launch
def test_fsdp_adds_one_collective_per_minibatch_and_survives_an_empty_one(fsdp_results):
    for k, case in enumerate(CASES):
        needs_counts = case.denominator in ("token", "sequence", "group")
        assert fsdp_results[0]["collectives"][k] == (1 if needs_counts else 0), case
        if case.lengths == EMPTY:
            grad = fsdp_results[0]["grads"][k]
            assert torch.isfinite(grad).all() and (grad == 0).all(), case
