"""Each rank scores 1/W of the batch, every rank gets the rows it trains on, and FSDP2 ranks call the model in lockstep.

With rollout reuse (``--minibatches-per-rollout`` > 1) or ``--beta`` > 0 the trainer needs the
sampling policy's and the reference's log-probs, on each rank for the rows it trains on
(``scoring.shares``). ``scoring.score`` computes them:

- the shares partition the batch, and rank r's share of minibatch k is exactly its rows of the
  plan that step k makes (so every row a rank trains on has its log-probs);
- each rank scores the rows ``step.scoring_split`` deals it: every row once, S / W per rank, the
  same cost on every rank (the shares need not balance: under ``--shard length`` rank 0 trains on
  the shortest rows, the control);
- one all-to-all (``step.route``) gives every rank the whole-batch scores on its share, zero
  elsewhere. The control: routing by the wrong shares gives other numbers.

FSDP2 turns every forward into a collective (each block's parameters are gathered), so ranks
whose rows split into different numbers of length chunks (``policy.length_chunks``) would pair
their gathers wrongly and hang (seen before the fix: two ranks making 1 and 3 forward calls
waited until the process group's timeout). The batch below makes the ranks chunk differently
(asserted); on 2 spawned gloo ranks the FSDP2 scores and gradients equal the ones of DDP and of an
unwrapped model, which they could not if the calls were not in lockstep.
"""

import contextlib
import copy

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from gradnorm import train
from gradnorm.core.denominators import mask_from_lengths
from gradnorm.dist import comm, wrap
from gradnorm.dist.spawn import spawn_gloo
from gradnorm.models.tinygpt import GPTConfig, TinyGPT
from gradnorm.trainer import scoring, step
from gradnorm.trainer.chunks import length_chunks, score_by_length
from gradnorm.trainer.config import TrainConfig
from gradnorm.trainer.policy import TinyGPTPolicy
from gradnorm.trainer.rollout import Rollout

P, R, V, G = 4, 24, 11, 8
NUM_PROMPTS = 16  # two minibatches of 8 prompt groups: 128 rows
CFG = TrainConfig(prompts_per_step=8, group_size=G, minibatches_per_rollout=2, shard="length", grad_accum_steps=1,
                  beta=0.04)


def rollout() -> Rollout:
    """Ragged responses, mostly short (lengths ~ R * u^3): the longest rows chunk, the short ones not."""
    g = torch.Generator().manual_seed(0)
    S = NUM_PROMPTS * G
    lengths = (torch.rand(S, generator=g) ** 3 * R).long().clamp(1, R)
    return Rollout(tokens=torch.randint(V, (S, P + R), generator=g), mask=mask_from_lengths(lengths, R),
                   rewards=torch.zeros(S), advantages=torch.randn(S, generator=g),
                   group_ids=torch.arange(S) // G, group_size=G, prompt_len=P)


def model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(GPTConfig(V, P + R, n_layer=2, n_head=2, n_embd=16))


class CountingPolicy(TinyGPTPolicy):
    """TinyGPT's policy, counting the rows and the forward calls its ``score`` is asked for."""

    def __init__(self, model):
        super().__init__(model)
        self.rows = self.calls = 0

    def score(self, module, tokens, prompt_len):
        self.rows, self.calls = self.rows + len(tokens), self.calls + 1
        return super().score(module, tokens, prompt_len)


def test_the_shares_partition_the_batch_by_the_plan_of_each_minibatch():
    batch = rollout()
    for world_size in (1, 2, 4):
        shares = scoring.shares(batch, CFG, world_size)
        everything = torch.cat(shares)
        assert sorted(everything.tolist()) == list(range(len(batch.rewards)))  # each row once
        for k in range(CFG.minibatches_per_rollout):
            minibatch = batch.groups(k * CFG.prompts_per_step, CFG.prompts_per_step)
            plan = step.plan_for(step.Minibatch(minibatch, None, None, ""), CFG, world_size)
            first, S = k * CFG.sequences_per_step, CFG.sequences_per_step
            for r, share in enumerate(shares):
                in_k = share[(share >= first) & (share < first + S)] - first
                planned = torch.cat(plan[r]) if plan[r] else torch.zeros(0, dtype=torch.long)
                assert in_k.tolist() == sorted(planned.tolist()), (world_size, k, r)


def cost(batch: Rollout, rows: Tensor) -> int:
    """The positions scoring ``rows`` computes, prompts included, padding not: what the split balances."""
    return int((batch.lengths[rows] + P).sum())


def test_the_scoring_split_deals_every_row_once_at_the_same_cost_on_every_rank():
    batch = rollout()
    S = len(batch.rewards)
    for world_size in (1, 2, 4):
        split = scoring.scoring_split(batch.lengths, world_size)
        assert sorted(torch.cat(split).tolist()) == list(range(S))  # each row once
        assert {len(rows) for rows in split} == {S // world_size}
        costs = [cost(batch, rows) for rows in split]
        assert max(costs) - min(costs) <= int(batch.lengths.max()), (world_size, costs)  # within one row
    # the control: the rows each rank trains on under --shard length are far from balanced
    shares = [cost(batch, rows) for rows in scoring.shares(batch, CFG, 2)]
    assert max(shares) > 2 * min(shares), shares


def test_sending_rows_to_other_ranks_without_their_process_group_is_an_error():
    logp = torch.zeros(3, R)
    assert comm.all_to_all_rows(logp, [3], [3]) is logp  # one rank: the identity
    with pytest.raises(RuntimeError, match="2 ranks needs their process group"):
        comm.all_to_all_rows(logp, [1, 2], [1, 2])


def test_the_batch_makes_the_ranks_chunk_differently():
    """The premise of the lockstep check: without it the ranks' forward calls would differ."""
    batch = rollout()
    shares = scoring.shares(batch, CFG, 2)
    assert len({len(length_chunks(batch.lengths[s], P)) for s in shares}) == 2
    minibatch = batch.groups(0, CFG.prompts_per_step)
    plan = step.plan_for(step.Minibatch(minibatch, None, None, ""), CFG, 2)
    assert len({len(length_chunks(minibatch.lengths[rank[0]], P)) for rank in plan}) == 2
    assert step.pass_calls(plan, minibatch.lengths, P, packed=False) == [2]
    assert len(set(scoring_chunks(batch))) == 2  # scoring's own rows too


def scoring_chunks(batch: Rollout) -> list[int]:
    """How many forward calls each of 2 ranks' scoring rows (``step.scoring_split``) take on their own."""
    return [len(length_chunks(batch.lengths[rows], P)) for rows in scoring.scoring_split(batch.lengths, 2)]


def lockstep_worker(ctx: comm.DistContext) -> dict:
    """On each of 2 ranks: the share's scores and one step's gradient, under FSDP2, DDP and unwrapped."""
    batch = rollout()
    shares = scoring.shares(batch, CFG, ctx.world_size)
    out = {}
    with torch.no_grad():
        plain = model()
        counting = CountingPolicy(plain)
        other = copy.deepcopy(plain)  # a second module (a reference the policy has left)
        torch.nn.init.normal_(other.lm_head.weight)
        out["plain_scores"], out["other_scores"] = scoring.score(counting, [plain, other], batch, shares, ctx.rank)
        out["plain_rows"] = counting.rows
        # every row here, one module at a time: the reference
        out["whole"], none = scoring.score(TinyGPTPolicy(plain), [plain, None], batch)
        out["other_whole"], = scoring.score(TinyGPTPolicy(other), [other], batch)
        assert none is None
        # the control: the right rows scored, sent by the wrong shares (each rank's to the other)
        split = scoring.scoring_split(batch.lengths, ctx.world_size)
        out["crossed"] = scoring.route(scoring.score_rows(TinyGPTPolicy(plain), plain, batch, split[ctx.rank]),
                                     split, shares[::-1], ctx.rank)
    minibatch = step.Minibatch(batch.groups(0, CFG.prompts_per_step), None, None, "")
    for parallel in ("ddp", "fsdp"):
        m = model()
        policy = CountingPolicy(m)
        dp_model = wrap.wrap_policy(policy.model, parallel, ctx, blocks=policy.blocks())
        with torch.no_grad():
            out[f"{parallel}_scores"], = scoring.score(policy, [m], batch, shares, ctx.rank)
        out[f"{parallel}_scoring_calls"] = policy.calls
        minibatch.old_logp = out["plain_scores"][: CFG.sequences_per_step]
        minibatch.ref_logp = minibatch.old_logp - 0.1  # a reference the policy has left: KL is not 0
        plan = step.plan_for(minibatch, CFG, ctx.world_size)
        train.step_gradient(dp_model, policy, minibatch, plan, CFG, ctx, contextlib.nullcontext)  # the loop's call
        out[f"{parallel}_grad"] = wrap.flat_grad(m)
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return spawn_gloo(lockstep_worker, 2)


@pytest.mark.launch
def test_every_rank_gets_the_whole_batch_scores_of_its_share_and_scores_half_the_rows(two_ranks):
    batch = rollout()
    S, shares = len(batch.rewards), scoring.shares(batch, CFG, 2)
    for rank, (r, share) in enumerate(zip(two_ranks, shares)):
        assert r["plain_rows"] == 2 * S // 2  # its half of the batch for each of two modules, not all S
        others = torch.ones(S, dtype=torch.bool)
        others[share] = False
        assert (r["plain_scores"][others] == 0).all()
        mask = batch.mask[share]  # outside it a chunk's scores are 0, a full-width forward's are not
        assert_close(r["plain_scores"][share][mask], r["whole"][share][mask], rtol=1e-5, atol=1e-6)
        assert_close(r["other_scores"][share][mask], r["other_whole"][share][mask], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(r["other_whole"][batch.mask], r["whole"][batch.mask], rtol=1e-3, atol=1e-3)  # two modules
        # the control: sent by the wrong shares, the rows this rank trains on get other numbers
        assert not torch.allclose(r["crossed"][share][mask], r["whole"][share][mask], rtol=1e-3, atol=1e-3)


@pytest.mark.launch
def test_fsdp2_ranks_score_and_train_in_lockstep_and_match_ddp(two_ranks):
    results = two_ranks
    natural = scoring_chunks(rollout())  # the calls each rank's rows take alone: they differ
    assert results[0]["fsdp_scoring_calls"] == results[1]["fsdp_scoring_calls"] == max(natural)  # the most
    assert [r["ddp_scoring_calls"] for r in results] == natural  # DDP needs no lockstep: its own chunks
    mask = rollout().mask  # outside it a chunk's scores are 0, a full-width forward's are not
    for r in results:
        assert_close(r["fsdp_scores"][mask], r["plain_scores"][mask], rtol=1e-5, atol=1e-6)
        assert_close(r["ddp_scores"], r["plain_scores"], rtol=0, atol=0)
        assert_close(r["fsdp_grad"], r["ddp_grad"], rtol=1e-4, atol=1e-6)
        assert r["ddp_grad"].norm() > 0
    assert torch.equal(results[0]["fsdp_grad"], results[1]["fsdp_grad"])


def test_extra_lockstep_calls_change_no_value_and_no_gradient():
    """The zero-weight calls (``score_by_length(..., calls=)``) against the same rows scored plainly."""
    batch = rollout()
    rows = torch.arange(16)
    natural = len(length_chunks(batch.lengths[rows], P))
    grads = {}
    for calls in (None, natural + 2):
        m = copy.deepcopy(model()).double()
        policy = CountingPolicy(m)
        logp = score_by_length(policy.score, m, batch.tokens[rows], P, batch.lengths[rows], calls=calls)[0]
        (logp * batch.mask[rows]).sum().backward()
        grads[calls] = (logp.detach(), torch.cat([p.grad.reshape(-1) for p in m.parameters()]), policy.calls)
    padded = grads[natural + 2]
    assert grads[None][2] == natural and padded[2] == natural + 2
    mask = batch.mask[rows]
    assert_close(padded[0][mask], grads[None][0][mask], rtol=1e-12, atol=1e-12)
    assert_close(padded[1], grads[None][1], rtol=1e-12, atol=1e-12)
