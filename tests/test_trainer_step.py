"""The trainer's own step code against a full-batch oracle whose weights are written out longhand.

One optimizer step of the real trainer path: TinyGPT, a rollout sampled by ``generate_rollout``
(ragged response lengths), a plan from ``make_plan``, the count all-reduce
``comm.global_counts``, the wrapper ``policy.wrap_for_training`` and ``update.accumulate_gradients``
with the trainer's per-token loss (clipped surrogate with clip-higher plus beta * k3 KL; the
old and reference log-probs are perturbed so that the clip and the KL both matter). W = 1 is the
plain ``python`` path in this process (no process group, no wrapper); W = 2 is two spawned gloo
ranks under DDP and under FSDP2.

The oracle is one process, the whole batch, float64, and weights computed by loops over the
response lengths (tests/longhand.py: 1/N, 1/(S_tok * |o_i|), 1/(N_groups * N_g), 1/C, and for ``local``
1/(W * A * N[r, m])), never by gradnorm's weight functions. What must hold: the trainer's flat
gradient equals the oracle's to fp32 rounding in every mode, for every (W, A, sharding); the
control: ``local`` under length sharding is far from the token oracle (and on its own formula).
"""

import pytest
import torch
from torch.testing import assert_close

from gradnorm.dist import comm, wrap
from gradnorm.dist.spawn import spawn_gloo
from gradnorm.core.grpo import grpo_token_losses
from gradnorm.trainer.policy import TinyGPTPolicy, wrap_for_training
from gradnorm.trainer.rollout import generate_rollout
from gradnorm.core.sharding import make_plan
from gradnorm.tasks import RepeatTask
from gradnorm.models.tinygpt import GPTConfig, TinyGPT, response_logprobs
from gradnorm.core.accumulate import accumulate_gradients
from longhand import longhand_weights  # tests/longhand.py

BETA, CONSTANT = 0.04, 333.0
MODES = ["token", "sequence", "group", CONSTANT, "local"]
SPLITS = [(1, "interleave"), (2, "length"), (2, "balanced")]  # (A, sharding)
CASES = [(mode, a, shard) for mode in MODES for a, shard in SPLITS]


def make_batch(dtype=torch.float32):
    """(model, rollout, old_logp, ref_logp): the same on every call, in this process or a spawned one."""
    task = RepeatTask(max_new_tokens=20)
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(task.vocab_size, task.block_size, n_layer=1, n_head=2, n_embd=32))
    rollout = generate_rollout(TinyGPTPolicy(model), task, num_prompts=4, group_size=4, seed=0, step=1, temperature=1.0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        logp = response_logprobs(model, rollout.tokens, rollout.prompt_len)[0].double()
    # An older sampling policy and a reference: ratios leave [0.8, 1.28] on both sides, KL is not 0.
    old_logp = logp + 0.3 * torch.randn(logp.shape, generator=g, dtype=torch.float64)
    ref_logp = logp + 0.1 * torch.randn(logp.shape, generator=g, dtype=torch.float64)
    return model.to(dtype), rollout, old_logp.to(dtype), ref_logp.to(dtype)


def per_token_loss(model, rollout, old_logp, ref_logp, idx):
    """What the trainer's ``token_losses`` closure computes for the sequences ``idx``."""
    logp, entropy = response_logprobs(model, rollout.tokens[idx], rollout.prompt_len)
    return grpo_token_losses(logp, old_logp[idx], rollout.advantages[idx].to(logp.dtype), ref_logp=ref_logp[idx],
                             beta=BETA, clip_low=0.2, clip_high=0.28, kl_estimator="k3", entropy=entropy.detach())


def trainer_gradients(ctx: comm.DistContext, parallel: str) -> torch.Tensor:
    """(len(CASES), P): this rank's reduced flat gradient of one trainer step per case."""
    model, rollout, old_logp, ref_logp = make_batch()
    dp_model = wrap_for_training(TinyGPTPolicy(model), parallel, ctx)
    grads = []
    for denominator, accum_steps, shard in CASES:
        plan = make_plan(shard, rollout.lengths, ctx.world_size, accum_steps)
        model.zero_grad(set_to_none=True)
        counts = comm.global_counts(plan[ctx.rank], rollout.lengths, rollout.group_ids, rollout.num_groups, denominator)
        accumulate_gradients(dp_model, plan[ctx.rank], rollout.mask, rollout.group_ids, counts, denominator,
                             lambda idx: per_token_loss(dp_model, rollout, old_logp, ref_logp, idx), ctx.world_size)
        grads.append(wrap.flat_grad(model))
    return torch.stack(grads)


def spawned_ranks(ctx: comm.DistContext) -> dict:
    """The worker of the W = 2 check (module level: spawned processes import it by name)."""
    return {parallel: trainer_gradients(ctx, parallel) for parallel in ("ddp", "fsdp")}


# ------------------------------------------------------------------ the longhand oracle


def oracle_gradient(denominator, world_size, accum_steps, shard) -> torch.Tensor:
    """dJ/dtheta, J = sum_i w_i sum_t l[i, t] M[i, t] over the whole batch at once, in float64."""
    model, rollout, old_logp, ref_logp = make_batch(torch.float64)
    lengths, groups = rollout.lengths.tolist(), rollout.group_ids.tolist()
    plan = make_plan(shard, rollout.lengths, world_size, accum_steps)
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


def test_one_process_matches_the_longhand_oracle(single):
    for k, (denominator, accum_steps, shard) in enumerate(CASES):
        expected = oracle_gradient(denominator, 1, accum_steps, shard)
        assert_fp32_close(single[k], expected, f"W=1 {CASES[k]}")


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_match_the_longhand_oracle(two_ranks, parallel):
    for k, (denominator, accum_steps, shard) in enumerate(CASES):
        expected = oracle_gradient(denominator, 2, accum_steps, shard)
        assert_fp32_close(two_ranks[parallel][k], expected, f"W=2 {parallel} {CASES[k]}")


def test_the_control_local_under_length_sharding_is_far_from_the_token_oracle(two_ranks, single):
    k = CASES.index(("local", 2, "length"))
    token_oracle = oracle_gradient("token", 2, 2, "length")
    for got in (two_ranks["ddp"][k], single[k]):
        with pytest.raises(AssertionError):
            assert_fp32_close(got, token_oracle)
        assert (got - token_oracle).norm() / token_oracle.norm() > 0.01
