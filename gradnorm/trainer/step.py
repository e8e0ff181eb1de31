"""One GRPO optimizer step on this rank: shard, count, accumulate, clip, step, and what it logs;
and, once per rollout batch, the log-probs its steps need.

With rollout reuse or ``--beta`` > 0, the sampling policy's and the reference's log-probs of the
rows each rank trains on (``shares``), scored before any update: each rank scores 1/W of the batch,
the same cost on every rank (``scoring_split``), and one all-to-all routes every row to the rank
that trains on it (``route``; ``score`` does all of it). Then steps 2 to 4 of
``gradnorm/train.py``'s docstring, in the order they run:

    plan    = make_plan(--shard, lengths, W, A)           which rank and microbatch holds which row
    counts  = comm.global_counts(plan[rank], ...)         THE all-reduce of counts (the fix)
    sums    = accumulate_gradients(..., counts, ...)      every microbatch's weighted backward
    norm    = clip the global gradient norm
    stats   = reduce_stats(sums)                          ONE all-reduce: statistics and stop votes
    apply_or_skip(opt, norm, stats)                       AdamW, or a skip when anything is non-finite

``Minibatch`` is what one step trains on (a slice of a rollout batch, with the sampling policy's
and the reference's log-probs when they exist); ``StepStats`` the step's global statistics, the
same on every rank; ``record`` turns them into one line of metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gradnorm.core.accumulate import accumulate_gradients
from gradnorm.core.grpo import NUM_STATS, TokenLosses, finalize_stats, grpo_token_losses
from gradnorm.core.sharding import Plan, budget_plan, make_plan, passes, tokens_per_rank
from gradnorm.core.simulate import effective_weights
from gradnorm.dist import comm, wrap
from gradnorm.trainer import guards
from gradnorm.trainer.config import TrainConfig
from gradnorm.trainer.policy import Policy, forward_positions, lockstep_calls, score_by_length, score_packed
from gradnorm.trainer.rollout import Rollout


@dataclass
class Minibatch:
    """The sequences of one optimizer step, on every rank (S = prompts-per-step * group-size rows)."""

    rollout: Rollout
    """Their tokens, response mask, rewards, advantages and prompt groups."""
    old_logp: Tensor | None
    """(S, R) log-probs of the sampling policy; None when fully on-policy (then logp.detach())."""
    ref_logp: Tensor | None
    """(S, R) log-probs of the reference policy; None when --beta is 0."""
    rollout_digest: str
    """A hash of the whole rollout batch it was cut from (``Rollout.digest``)."""
    pad_id: int | None = None
    """The id that left-pads prompts (``Policy.pad_id``): padding, for ``padding_fraction``."""


@dataclass
class StepStats:
    """The global statistics of one step (token means over the minibatch), the same on every rank."""

    loss: float
    """J, the objective the step minimized."""
    tokens: int
    """N, response tokens of the minibatch over all ranks."""
    pg_loss: float
    clipfrac: float
    entropy: float
    kl: float | None
    """None when --beta is 0."""
    stop: signal.Signals | None
    """The stop every rank agreed on (SIGTERM or SIGINT to any rank, ``guards.agreed``), or None."""

    def logged(self) -> dict[str, float]:
        """The fields metrics.jsonl holds (kl only when there is one)."""
        values = dict(loss=self.loss, tokens=self.tokens, pg_loss=self.pg_loss, kl=self.kl,
                      clipfrac=self.clipfrac, entropy=self.entropy)
        return {k: v for k, v in values.items() if v is not None}

    def finite(self) -> bool:
        return all(math.isfinite(v) for v in self.logged().values())


def token_losses(policy: Policy, module: nn.Module, batch: Minibatch, cfg: TrainConfig,
                 autocast: Callable[[], contextlib.AbstractContextManager],
                 calls: list[int] | None = None) -> Callable[[Tensor], TokenLosses]:
    """The forward pass of one microbatch ``idx`` (rows of the minibatch), through DDP or FSDP2.

    ``calls[p]`` (FSDP2 on several ranks: ``pass_calls``) is how many forward calls pass p makes on
    every rank; the passes come in order, one ``forward`` each.
    """
    mb, P = batch.rollout, batch.rollout.prompt_len
    per_pass = iter(calls) if calls is not None else None

    def forward(idx: Tensor) -> TokenLosses:
        with autocast():  # fp32 log-probs either way; --pack runs one padding-free forward
            if cfg.pack:
                logp, entropy = score_packed(policy, module, mb.tokens[idx], P, mb.lengths[idx])
            else:
                logp, entropy = score_by_length(policy.score, module, mb.tokens[idx], P, mb.lengths[idx],
                                                calls=None if per_pass is None else next(per_pass))
        return grpo_token_losses(
            logp, logp.detach() if batch.old_logp is None else batch.old_logp[idx], mb.advantages[idx],
            ref_logp=None if batch.ref_logp is None else batch.ref_logp[idx], beta=cfg.beta,
            clip_low=cfg.clip_low, clip_high=cfg.clip_high, kl_estimator=cfg.kl_estimator, entropy=entropy.detach(),
        )

    return forward


def shares(rollout: Rollout, cfg: TrainConfig, world_size: int) -> list[Tensor]:
    """The rows of a rollout batch each rank trains on over its updates: ``shares(...)[r]`` (sorted).

    Minibatch k of the rollout is its groups [k * prompts-per-step, (k + 1) * prompts-per-step),
    split by the plan ``plan_for`` makes for it at its step; rank r trains on its rows of every
    minibatch (each epoch repeats them). Only those rows need the sampling policy's and the
    reference's log-probs on rank r: about 1/W of the batch, not all of it.
    """
    S = cfg.sequences_per_step
    rows: list[list[Tensor]] = [[] for _ in range(world_size)]
    for k in range(cfg.minibatches_per_rollout):
        minibatch = rollout.groups(k * cfg.prompts_per_step, cfg.prompts_per_step)
        for r, microbatches in enumerate(plan_for(Minibatch(minibatch, None, None, ""), cfg, world_size)):
            rows[r] += [mb.cpu() + k * S for mb in microbatches]
    empty = torch.zeros(0, dtype=torch.long)
    return [torch.cat(r).sort().values if r else empty for r in rows]


def scoring_split(lengths: Tensor, world_size: int) -> list[Tensor]:
    """The rows of a rollout batch each rank scores (``score``): every row once, balanced by cost.

    lengths (S,) the response lengths. The rows are sorted longest first and dealt out in snake
    order (ranks 0, 1, ..., W-1, then W-1, ..., 0, and again), so each rank holds S / W rows (give
    or take one) with the same spread of lengths, and its length chunks cost the same. The rows a
    rank trains on (``shares``) follow the plan instead, which need not balance cost: under
    ``--shard length`` rank 0 trains on the shortest responses.
    """
    order = torch.argsort(lengths.cpu(), descending=True, stable=True)  # (S,) longest first
    lap, seat = torch.arange(len(order)).div(world_size, rounding_mode="floor"), torch.arange(len(order)) % world_size
    rank_of = torch.where(lap % 2 == 0, seat, world_size - 1 - seat)  # (S,) which rank the k-th longest goes to
    return [order[rank_of == r].sort().values for r in range(world_size)]


def score_rows(policy: Policy, module: nn.Module, rollout: Rollout, rows: Tensor, calls: int | None = None,
               packed: bool = False) -> Tensor:
    """(n, R) log-probs under ``module`` of ``rows`` (n,) of the rollout batch, in that order.

    A forward needs a row, so ``rows`` empty scores a throwaway copy of row 0 (and returns it: (1, R)).
    ``calls`` makes exactly that many forward calls (``score_by_length``; FSDP2's lockstep).
    """
    P = rollout.prompt_len
    scored = rows.to(rollout.tokens.device) if len(rows) else rows.new_zeros(1, device=rollout.tokens.device)
    tokens, lengths = rollout.tokens[scored], rollout.lengths[scored]
    if packed:
        return score_packed(policy, module, tokens, P, lengths)[0]
    return score_by_length(policy.score, module, tokens, P, lengths, calls=calls)[0]


def route(scored: Tensor, split: list[Tensor], shares: list[Tensor], rank: int) -> Tensor:
    """(S, ...): every row's scores sent to the rank that trains on it; this rank's rows filled, 0 elsewhere.

    ``scored`` (n, ...) holds the rows ``split[rank]`` this rank scored, in that order. One
    all-to-all: rank r sends rank q the rows of ``split[r]`` that ``shares[q]`` holds. Every rank
    knows every split and every share (both come from the global lengths), so no collective is
    needed to agree on the sizes, and each rank moves only its own rows, about S / W of them.
    """
    S, W = sum(len(s) for s in shares), len(shares)
    owner = torch.empty(S, dtype=torch.long)  # (S,) the rank that trains on each row
    for q, share in enumerate(shares):
        owner[share.cpu()] = q
    sent_to = owner[split[rank].cpu()]  # (n,)
    order = torch.argsort(sent_to, stable=True).to(scored.device)  # grouped by destination, rows ascending
    from_each = [split[p].cpu()[owner[split[p].cpu()] == rank] for p in range(W)]  # what each rank sends here: O(S)
    received = comm.all_to_all_rows(scored[order], torch.bincount(sent_to, minlength=W).tolist(),
                                    [len(rows) for rows in from_each])
    return scored.new_zeros(S, *scored.shape[1:]).index_put((torch.cat(from_each).to(scored.device),), received)


def score(policy: Policy, modules: list[nn.Module | None], rollout: Rollout, shares: list[Tensor] | None = None,
          rank: int = 0, packed: bool = False) -> list[Tensor | None]:
    """(S, R) log-probs under each of ``modules`` (the sampling policy, the reference; None: not
    needed, no forward) of the rows rank ``rank`` trains on, ``shares[rank]`` (``shares``), zero on
    every other row; every row when ``shares`` is None.

    With W = len(shares) ranks each one scores 1/W of the batch balanced by cost
    (``scoring_split``), not its own rows, whose cost the plan can make lopsided; then ``route``
    sends every row's log-probs, of all the modules at once, to the rank that trains on it: one
    all-to-all, which every rank calls together. Under FSDP2 every forward is a collective, so each
    rank makes as many forward calls as the rank whose rows need the most (``lockstep_calls``,
    from every rank's rows, which each rank knows); a rank with no rows makes them on a throwaway
    copy of row 0.
    """
    needed = [m for m in modules if m is not None]
    if not needed:
        return [None] * len(modules)
    if shares is None or len(shares) == 1:  # one rank trains on every row
        rows, split = torch.arange(len(rollout.rewards)), None
    else:
        split = scoring_split(rollout.lengths, len(shares))
        rows = split[rank]
    scored = []
    for module in needed:
        lockstep = split is not None and wrap.is_fsdp(module) and not packed
        calls = lockstep_calls(split, rollout.lengths, rollout.prompt_len) if lockstep else None
        logp = score_rows(policy, module, rollout, rows, calls, packed)  # (n, R), or a throwaway row's (1, R)
        scored.append(logp[: len(rows)])
    stacked = torch.stack(scored, dim=1)  # (n, M, R): the modules' scores travel together
    if split is not None:
        stacked = route(stacked, split, shares, rank)  # (S, M, R)
    out = iter(stacked.unbind(1))
    return [None if m is None else next(out) for m in modules]


def plan_for(batch: Minibatch, cfg: TrainConfig, world_size: int) -> Plan:
    """Step 2: every rank's microbatches of the minibatch (the same plan on every rank).

    A fixed count (--grad-accum-steps), or a token budget (--microbatch-tokens): then ranks hold
    different numbers of microbatches, and every rank knows them all, since every rank computes
    the whole plan from the global lengths.
    """
    lengths = batch.rollout.lengths.cpu()
    if cfg.microbatch_tokens:
        return budget_plan(cfg.shard, lengths, world_size, cfg.microbatch_tokens, batch.rollout.prompt_len)
    return make_plan(cfg.shard, lengths, world_size, cfg.grad_accum_steps)


def counts_for(batch: Minibatch, plan: Plan, cfg: TrainConfig, rank: int):
    """Step 3a: THE all-reduce of this rank's token counts (none for local and a constant)."""
    mb = batch.rollout
    return comm.global_counts(plan[rank], mb.lengths, mb.group_ids, mb.num_groups, cfg.denominator)


def backward(policy: Policy, module: nn.Module, batch: Minibatch, plan: Plan, counts, cfg: TrainConfig,
             ctx: comm.DistContext, autocast) -> Tensor:
    """Step 3b: every microbatch's weighted backward; this rank's statistic sums (NUM_STATS,) float64."""
    mb = batch.rollout
    lockstep = ctx.world_size > 1 and wrap.is_fsdp(module)  # FSDP2: every forward is a collective
    return accumulate_gradients(module, plan[ctx.rank], mb.mask, mb.group_ids, counts, cfg.denominator,
                                token_losses(policy, module, batch, cfg, autocast,
                                             pass_calls(plan, mb.lengths, mb.prompt_len, cfg.pack) if lockstep else None),
                                ctx.world_size, num_passes=passes(plan))  # a rank with fewer microbatches runs idle passes


def pass_calls(plan: Plan, lengths: Tensor, prompt_len: int, packed: bool) -> list[int]:
    """The forward calls of each pass of ``accumulate_gradients``, the same on every rank: the most
    that any rank's rows of that pass chunk into (``lockstep_calls``). A rank's idle passes come
    first and score one row; its microbatches follow, in the order it runs them."""
    num = passes(plan)
    filler = torch.zeros(1, dtype=torch.long)
    by_pass = [[filler] * (num - len(rank)) + list(rank) for rank in plan]  # [rank][pass] -> rows
    return [lockstep_calls([rank[p] for rank in by_pass], lengths, prompt_len, packed) for p in range(num)]


def clip(policy: Policy, max_norm: float) -> Tensor:
    """Step 4a: clip the global gradient norm (over FSDP2 shards too); the norm before clipping."""
    return wrap.clip_grad_norm(policy.model, max_norm)


def reduce_stats(local_sums: Tensor, with_kl: bool) -> StepStats:
    """Step 4b: ONE all-reduce of [this rank's statistic sums | its stop votes], split by name.

    The logging collective, the same in every mode (not the normalization's count all-reduce).
    The stop votes ride it so that the ranks agree on a stop at no extra collective.
    """
    reduced = comm.all_reduce_sum(torch.cat([local_sums, guards.votes(local_sums)])).cpu()
    sums, votes = reduced[:NUM_STATS], reduced[NUM_STATS:]
    values = finalize_stats(sums, with_kl=with_kl)
    return StepStats(loss=values["loss"], tokens=values["tokens"], pg_loss=values["pg_loss"],
                     clipfrac=values["clipfrac"], entropy=values["entropy"], kl=values.get("kl"),
                     stop=guards.agreed(votes))


def apply_or_skip(opt: torch.optim.Optimizer, grad_norm: Tensor, stats: StepStats, skips, step: int,
                  max_skipped_steps: int) -> None:
    """Step 4c: step the optimizer, or skip the update when the loss or the gradient is not finite.

    grad_norm (after DDP's all-reduce) and the stats (all-reduced) are the same on every rank, so
    every rank takes the same decision without another collective. NaN never reaches the weights.
    ``skips`` has ``skipped`` and ``in_a_row`` (the run's counters, checkpointed).
    """
    if bool(torch.isfinite(grad_norm)) and stats.finite():
        opt.step()
        skips.in_a_row = 0
        return
    opt.zero_grad(set_to_none=True)
    skips.skipped, skips.in_a_row = skips.skipped + 1, skips.in_a_row + 1
    comm.print0(f"warning: step {step}: non-finite loss or gradient (loss {stats.loss}, grad_norm "
                f"{float(grad_norm)}); skipped the update ({skips.in_a_row} in a row, "
                f"--max-skipped-steps {max_skipped_steps})", file=sys.stderr)


def skew(batch: Minibatch, plan: Plan, cfg: TrainConfig) -> dict:
    """What the legacy per-microbatch mean would have done to this step's data, and the padding.

    From the plan and the lengths every rank already holds (no collective), the weights of
    ``local`` and of the run's mode (``token`` when the run is ``local`` itself) for every response
    token, as the simulation computes them:

        skew_max, skew_min   the largest and smallest w_local / w_mode over the tokens: how much
                             louder (or quieter) the old averaging makes a token than the run does
        rank_share_gap       max over ranks of |rank r's share of the update under local - its
                             share of the tokens N_r / N|: how far the old averaging moves the update
        mb_tokens_min, _max  the fewest and most response tokens of a microbatch, N[r, m]
        padding_fraction     positions the forward passes computed that hold no token (padding),
                             over all the positions they computed (idle passes not counted)
    """
    mb = batch.rollout
    lengths, mask, P = mb.lengths.cpu(), mb.mask.cpu(), mb.prompt_len
    group_ids = mb.group_ids.cpu()
    mode = "token" if cfg.denominator == "local" else cfg.denominator
    legacy = effective_weights(mask, group_ids, mb.num_groups, "local", plan)  # (S, R) float64
    fixed = effective_weights(mask, group_ids, mb.num_groups, mode, plan)
    kept = mask & (fixed > 0)
    ratio = legacy[kept] / fixed[kept]
    tokens = [[int(lengths[m].sum()) for m in rank] for rank in plan]
    N = max(sum(map(sum, tokens)), 1)
    gap = max(abs(float(legacy[rank_rows].sum()) - sum(rank_tokens) / N)
              for rank_rows, rank_tokens in ((torch.cat(r) if r else torch.zeros(0, dtype=torch.long), n)
                                             for r, n in zip(plan, tokens)))
    tokens_cpu = mb.tokens.cpu()
    left_pad = (torch.zeros(len(lengths), dtype=torch.long) if batch.pad_id is None
                else (torch.cumsum(tokens_cpu[:, :P] != batch.pad_id, dim=1) == 0).sum(1))  # (S,) padding of a prompt
    real = computed = 0
    for rank in plan:
        for rows in rank:
            real += int((lengths[rows] + P - left_pad[rows]).sum())
            computed += forward_positions(tokens_cpu[rows], lengths[rows], P, batch.pad_id, packed=cfg.pack)
    flat = [n for rank in tokens for n in rank]
    return {"skew_max": float(ratio.max()) if len(ratio) else 1.0, "skew_min": float(ratio.min()) if len(ratio) else 1.0,
            "rank_share_gap": gap, "mb_tokens_min": min(flat, default=0), "mb_tokens_max": max(flat, default=0),
            "padding_fraction": 1.0 - real / max(computed, 1)}


def record(step: int, stats: StepStats, grad_norm: Tensor, batch: Minibatch, plan: Plan, skipped: int,
           cfg: TrainConfig, with_skew: bool = True) -> dict:
    """One line of metrics.jsonl, before its timings: global statistics of the step (non-finite as
    null), and what the legacy mean would have done to it (``skew``; only where the line is written:
    rank 0, since every rank would compute the same numbers)."""
    mb = batch.rollout
    lengths = mb.lengths.cpu()
    values = {
        "step": step, "loss": stats.loss, "grad_norm": float(grad_norm),
        "reward_mean": float(mb.rewards.mean()), "exact_match": float((mb.rewards == 1.0).float().mean()),
        "response_len_mean": float(lengths.float().mean()), "response_len_max": int(lengths.max()),
        "tokens": stats.tokens, "tokens_per_rank": tokens_per_rank(plan, lengths),
        **{k: v for k, v in stats.logged().items() if k in ("pg_loss", "kl", "clipfrac", "entropy")},
        "rollout_digest": batch.rollout_digest, "skipped_steps": skipped, **(skew(batch, plan, cfg) if with_skew else {}),
    }
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in values.items()}
