"""The trainer's own step code against a full-batch oracle whose weights are written out longhand.

One optimizer step of the real trainer path: TinyGPT, a rollout sampled by ``generate_rollout``
(ragged response lengths), the plan (``step.plan_for``: a fixed count of microbatches, or a token
budget that gives the two ranks 1 and 3 microbatches), the count all-reduce (``comm.global_counts``),
the wrapper ``wrap.wrap_policy`` and the trainer's own ``step_gradient`` (gradnorm/train.py: the count
all-reduce, then each microbatch's forward, per-token loss, weights times W and backward; the loss is the
clipped surrogate with clip-higher plus beta * k3 KL; the old and reference log-probs are
perturbed so that the clip and the KL both matter), padded or packed (``--pack``). W = 1 is the
plain ``python`` path in this process (no process group, no wrapper); W = 2 is two spawned gloo
ranks under DDP and under FSDP2.

The oracle is one process, the whole batch, float64, and weights computed by loops over the
response lengths (tests/helpers/longhand.py: 1/N, 1/(S_tok * |o_i|), 1/(N_groups * N_g), 1/C, and for ``local``
1/(W * A * N[r, m])), never by gradnorm's weight functions. What must hold: the trainer's flat
gradient equals the oracle's to fp32 rounding in every mode, for every (W, A, sharding); the
control: ``local`` under length sharding is far from the token oracle (and on its own formula).
"""

import contextlib

import pytest
import torch
from tests.helpers.longhand import longhand_weights
from torch.testing import assert_close

from gradnorm import train
from gradnorm.core.grpo import grpo_token_losses
from gradnorm.core.sharding import make_plan
from gradnorm.dist import comm, wrap
from gradnorm.dist.spawn import spawn_gloo
from gradnorm.models.tinygpt import GPTConfig, TinyGPT, response_logprobs
from gradnorm.tasks import RepeatTask
from gradnorm.trainer import step
from gradnorm.trainer.config import TrainConfig
from gradnorm.trainer.policy import TinyGPTPolicy
from gradnorm.trainer.rollout import generate_rollout

BETA, CONSTANT = 0.04, 333.0
MODES = ["token", "sequence", "group", CONSTANT, "local"]
BUDGET = 78  # tokens: under length sharding on 2 ranks, rank 0 holds 1 microbatch and rank 1 holds 3
# (A, sharding, --microbatch-tokens, --pack); test_the_budget_gives_the_ranks_1_and_3_microbatches
SPLITS = [(1, "interleave", 0, False), (2, "length", 0, False), (2, "balanced", 0, False),
          (1, "length", BUDGET, False), (2, "length", 0, True), (1, "length", BUDGET, True)]
CASES = [(mode, *split) for mode in MODES for split in SPLITS]


def make_batch(dtype=torch.float32):
    """(model, rollout, old_logp, ref_logp): the same on every call, in this process or a spawned one."""
    task = RepeatTask(max_new_tokens=20)
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(task.vocab_size, task.block_size, n_layer=1, n_head=2, n_embd=32))
    # seed 6: lengths from 2 to 20 (test_the_rollout_is_ragged_enough_to_matter), and a budget of 78
    # tokens that gives the two ranks 1 and 3 microbatches (test_the_budget_gives_the_ranks_1_and_3_...)
    rollout = generate_rollout(TinyGPTPolicy(model), task, num_prompts=4, group_size=4, seed=6, step=1, temperature=1.0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        logp = response_logprobs(model, rollout.tokens, rollout.prompt_len)[0].double()
    # An older sampling policy and a reference: ratios leave [0.8, 1.28] on both sides, KL is not 0.
    old_logp = logp + 0.3 * torch.randn(logp.shape, generator=g, dtype=torch.float64)
    ref_logp = logp + 0.1 * torch.randn(logp.shape, generator=g, dtype=torch.float64)
    return model.to(dtype), rollout, old_logp.to(dtype), ref_logp.to(dtype)


def config(denominator, accum_steps, shard, budget, pack) -> TrainConfig:
    return TrainConfig(loss_denominator=str(denominator), grad_accum_steps=accum_steps, shard=shard,
                       microbatch_tokens=budget, pack=pack, beta=BETA, clip_low=0.2, clip_high=0.28)


def per_token_loss(model, rollout, old_logp, ref_logp, idx):
    """What the trainer's ``step_gradient`` computes for the sequences ``idx`` (the oracle's)."""
    logp, entropy = response_logprobs(model, rollout.tokens[idx], rollout.prompt_len)
    return grpo_token_losses(logp, old_logp[idx], rollout.advantages[idx].to(logp.dtype), ref_logp=ref_logp[idx],
                             beta=BETA, clip_low=0.2, clip_high=0.28, kl_estimator="k3", entropy=entropy.detach())


def trainer_gradients(ctx: comm.DistContext, parallel: str) -> torch.Tensor:
    """(len(CASES), P): this rank's reduced flat gradient of one trainer step per case."""
    model, rollout, old_logp, ref_logp = make_batch()
    policy = TinyGPTPolicy(model)
    dp_model = wrap.wrap_policy(policy.model, parallel, ctx, blocks=policy.blocks())
    batch = step.Minibatch(rollout=rollout, old_logp=old_logp, ref_logp=ref_logp, rollout_digest=rollout.digest())
    grads = []
    for case in CASES:
        cfg = config(*case)
        plan = step.plan_for(batch, cfg, ctx.world_size)
        model.zero_grad(set_to_none=True)
        train.step_gradient(dp_model, policy, batch, plan, cfg, ctx, contextlib.nullcontext)  # what the loop calls
        grads.append(wrap.flat_grad(model))
    return torch.stack(grads)


def spawned_ranks(ctx: comm.DistContext) -> dict:
    """The worker of the W = 2 check (module level: spawned processes import it by name)."""
    return {parallel: trainer_gradients(ctx, parallel) for parallel in ("ddp", "fsdp")}


# ------------------------------------------------------------------ the longhand oracle


def oracle_gradient(denominator, world_size, accum_steps, shard, budget=0, pack=False) -> torch.Tensor:
    """dJ/dtheta, J = sum_i w_i sum_t l[i, t] M[i, t] over the whole batch at once, in float64, padded."""
    model, rollout, old_logp, ref_logp = make_batch(torch.float64)
    lengths, groups = rollout.lengths.tolist(), rollout.group_ids.tolist()
    plan = step.plan_for(step.Minibatch(rollout, None, None, ""), config(denominator, accum_steps, shard, budget, pack),
                          world_size)  # only local reads it
    w = torch.tensor(longhand_weights(denominator, lengths, groups, plan), dtype=torch.float64)
    loss = per_token_loss(model, rollout, old_logp, ref_logp, torch.arange(len(lengths))).loss
    objective = (w.unsqueeze(-1) * torch.where(rollout.mask, loss, 0.0)).sum()
    objective.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).float()


def assert_fp32_close(got, expected, msg=""):
    """Equal to fp32 rounding: as a whole (measured: a few 1e-7 of the norm) and element by element."""
    relative = float((got - expected).norm() / expected.norm())
    assert relative < 1e-5, f"{msg}: the gradient is off by {relative:.2e} of its norm"
    assert_close(got, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()), msg=lambda m: f"{msg}: {m}")


# ------------------------------------------------------------------ the checks


@pytest.fixture(scope="module")
def single():
    """W = 1: the plain-python trainer path in this process (comm.setup sees no torchrun)."""
    ctx = comm.setup(backend=None, device="cpu")
    assert ctx.backend is None and ctx.world_size == 1
    return trainer_gradients(ctx, "ddp")


@pytest.fixture(scope="module")
def two_ranks():
    results = spawn_gloo(spawned_ranks, 2)
    for parallel in ("ddp", "fsdp"):
        assert torch.equal(results[0][parallel], results[1][parallel])  # every rank holds the same gradient
    return results[0]


def test_the_rollout_is_ragged_enough_to_matter():
    model, rollout, old_logp, ref_logp = make_batch()
    lengths = rollout.lengths
    plan = make_plan("length", lengths, 2, 2)
    per_mb = [int(lengths[mb].sum()) for rank in plan for mb in rank]
    assert min(per_mb) * 2 < max(per_mb), per_mb  # microbatch token counts differ by more than 2x
    terms = per_token_loss(model, rollout, old_logp, ref_logp, torch.arange(len(lengths)))
    assert terms.clipped[rollout.mask].any() and (terms.kl[rollout.mask].abs() > 0).any()


def test_the_budget_gives_the_ranks_1_and_3_microbatches():
    _, rollout, _, _ = make_batch()
    plan = step.plan_for(step.Minibatch(rollout, None, None, ""), config("token", 1, "length", BUDGET, False), 2)
    assert [len(rank) for rank in plan] == [1, 3]
    assert max(int((rollout.lengths[mb] + rollout.prompt_len).sum()) for rank in plan for mb in rank) <= BUDGET


def test_one_process_matches_the_longhand_oracle(single):
    for k, case in enumerate(CASES):
        expected = oracle_gradient(*case[:1], 1, *case[1:])
        assert_fp32_close(single[k], expected, f"W=1 {CASES[k]}")


@pytest.mark.launch
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_match_the_longhand_oracle(two_ranks, parallel):
    for k, case in enumerate(CASES):
        expected = oracle_gradient(*case[:1], 2, *case[1:])
        assert_fp32_close(two_ranks[parallel][k], expected, f"W=2 {parallel} {CASES[k]}")


@pytest.mark.launch
def test_the_control_local_under_a_budget_differs_from_the_padded_fixed_count_step(two_ranks):
    # local under the budget divides by each rank's own count (1 and 3): far from the token oracle
    # and from local with two equal microbatches per rank, while token is the same under both
    budget, fixed = CASES.index(("local", 1, "length", BUDGET, False)), CASES.index(("local", 2, "length", 0, False))
    for parallel in ("ddp", "fsdp"):
        got = two_ranks[parallel][budget]
        assert (got - two_ranks[parallel][fixed]).norm() / got.norm() > 0.01
        assert (got - oracle_gradient("token", 2, 1, "length", BUDGET)).norm() / got.norm() > 0.01
    token_budget, token_fixed = CASES.index(("token", 1, "length", BUDGET, True)), CASES.index(("token", 2, "length", 0, False))
    assert_fp32_close(two_ranks["ddp"][token_budget], two_ranks["ddp"][token_fixed], "token: packed budget vs padded A=2")


@pytest.mark.launch
def test_the_control_local_under_length_sharding_is_far_from_the_token_oracle(two_ranks, single):
    k = CASES.index(("local", 2, "length", 0, False))
    token_oracle = oracle_gradient("token", 2, 2, "length")
    for got in (two_ranks["ddp"][k], single[k]):
        with pytest.raises(AssertionError):
            assert_fp32_close(got, token_oracle)
        assert (got - token_oracle).norm() / token_oracle.norm() > 0.01
