"""The pieces of one GRPO optimizer step that the loop of ``gradnorm/train.py`` calls, in the order
its docstring describes them: ``plan_for`` (which rank and microbatch holds which row),
``rank_passes`` (the passes a rank runs, idle ones included) and ``score`` (the forward pass of a
microbatch, with ``pass_calls`` under FSDP2), ``reduce_stats``
(ONE all-reduce of the statistics and the ranks' stop votes) and ``apply_or_skip`` (AdamW, or a skip
when anything is non-finite).

``Minibatch`` is what one step trains on (a slice of a rollout batch, with the sampling policy's
and the reference's log-probs when they exist); ``StepStats`` the step's global statistics, the
same on every rank.
"""

from __future__ import annotations

import math
import signal
import sys
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gradnorm.core.grpo import NUM_STATS, finalize_stats
from gradnorm.core.sharding import Plan, budget_plan, make_plan, passes
from gradnorm.dist import comm
from gradnorm.trainer.chunks import lockstep_calls, score_by_length
from gradnorm.trainer.config import TrainConfig
from gradnorm.trainer.guards import preemption
from gradnorm.trainer.packing import score_packed
from gradnorm.trainer.policy import Policy
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
    kept: Tensor | None = None
    """(S, R) bool: the tokens the loss and the counts take, when --engine-correction mask drops some
    (``gradnorm.core.importance``); None: the response mask, ``rollout.mask``."""
    importance_weight: Tensor | None = None
    """(S, R): each token's surrogate factor under --engine-correction truncate; None: 1."""

    @property
    def loss_mask(self) -> Tensor:
        """(S, R) bool: the tokens the loss weights and the normalization counts."""
        return self.rollout.mask if self.kept is None else self.kept


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
    """The stop every rank agreed on (SIGTERM or SIGINT to any rank, ``preemption.agreed``), or None."""

    def logged(self) -> dict[str, float]:
        """The fields metrics.jsonl holds (kl only when there is one)."""
        values = dict(loss=self.loss, tokens=self.tokens, pg_loss=self.pg_loss, kl=self.kl,
                      clipfrac=self.clipfrac, entropy=self.entropy)
        return {k: v for k, v in values.items() if v is not None}

    def finite(self) -> bool:
        return all(math.isfinite(v) for v in self.logged().values())


def score(policy: Policy, module: nn.Module, rows: Rollout, idx: Tensor, pack: bool,
          calls: int | None) -> tuple[Tensor, Tensor]:
    """(logp, entropy), each (n, R): the forward pass of the rows ``idx`` of the minibatch, through
    DDP or FSDP2, with gradients. ``--pack`` runs one padding-free forward (``score_packed``);
    otherwise rows of similar response length are scored together, each chunk cut to its longest
    response (``score_by_length``), in ``calls`` forward calls under FSDP2 on several ranks
    (``pass_calls``: every forward there is a collective), as many as it takes otherwise (None)."""
    if pack:
        return score_packed(policy, module, rows.tokens[idx], rows.prompt_len, rows.lengths[idx])
    return score_by_length(policy.score, module, rows.tokens[idx], rows.prompt_len, rows.lengths[idx], calls=calls)


def rank_passes(plan: Plan, rank: int) -> list[tuple[Tensor, bool]]:
    """(rows, idle) of each pass this rank runs in one step, in order.

    Every rank runs the same number of passes, ``passes(plan)``, the most microbatches any rank
    holds: FSDP2 gathers parameters in every forward and DDP's hooks fire in every backward, so a
    rank that skipped one would leave the others waiting. A rank with fewer microbatches runs idle
    passes first: one row of the minibatch, which the loop gives an all-False mask, so its weight
    and its gradient are exactly zero while the forward and the backward still touch every parameter.
    """
    mine = list(plan[rank])
    filler = mine[0][:1] if mine and len(mine[0]) else torch.zeros(1, dtype=torch.long)
    return [(filler, True)] * (passes(plan) - len(mine)) + [(mb, False) for mb in mine]


def plan_for(batch: Minibatch, cfg: TrainConfig, world_size: int) -> Plan:
    """Every rank's microbatches of the minibatch (the same plan on every rank).

    A fixed count (--grad-accum-steps), or a token budget (--microbatch-tokens): then ranks hold
    different numbers of microbatches, and every rank knows them all, since every rank computes
    the whole plan from the global lengths.
    """
    lengths = batch.rollout.lengths.cpu()
    if cfg.microbatch_tokens:
        return budget_plan(cfg.shard, lengths, world_size, cfg.microbatch_tokens, batch.rollout.prompt_len)
    return make_plan(cfg.shard, lengths, world_size, cfg.grad_accum_steps)


def pass_calls(plan: Plan, lengths: Tensor, prompt_len: int, packed: bool) -> list[int]:
    """The forward calls of each pass of a step (``rank_passes``), the same on every rank: the most
    that any rank's rows of that pass chunk into (``lockstep_calls``). A rank's idle passes come
    first and score one row; its microbatches follow, in the order it runs them."""
    num = passes(plan)
    filler = torch.zeros(1, dtype=torch.long)
    by_pass = [[filler] * (num - len(rank)) + list(rank) for rank in plan]  # [rank][pass] -> rows
    return [lockstep_calls([rank[p] for rank in by_pass], lengths, prompt_len, packed) for p in range(num)]


def reduce_stats(local_sums: Tensor, with_kl: bool) -> StepStats:
    """ONE all-reduce of [this rank's statistic sums | its stop votes], split by name.

    The logging collective, the same in every mode (not the normalization's count all-reduce).
    The stop votes ride it so that the ranks agree on a stop at no extra collective.
    """
    reduced = comm.all_reduce_sum(torch.cat([local_sums, preemption.votes(local_sums)])).cpu()
    sums, votes = reduced[:NUM_STATS], reduced[NUM_STATS:]
    values = finalize_stats(sums, with_kl=with_kl)
    return StepStats(loss=values["loss"], tokens=values["tokens"], pg_loss=values["pg_loss"],
                     clipfrac=values["clipfrac"], entropy=values["entropy"], kl=values.get("kl"),
                     stop=preemption.agreed(votes))


def apply_or_skip(opt: torch.optim.Optimizer, grad_norm: Tensor, stats: StepStats, skips, step: int,
                  max_skipped_steps: int) -> None:
    """Step the optimizer, or skip the update when the loss or the gradient is not finite.

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
