"""Measuring a loss: its per-token weights under one layout, read off the gradient.

Method. The per-token log-probs are a leaf tensor. The user's microbatch loss runs under a
simulated (W, A, sharding): the trainer's accumulation convention (backward as returned, or
divided by A), gradients added over a rank's microbatches, then DDP's mean (or sum) over ranks,
the arithmetic of ``gradnorm.core.simulate``. On policy (old_logp = ref_logp = logp, so rho = 1, the
clip is inactive and a k2/k3 KL has zero gradient) the surrogate -rho * A_i has derivative -A_i,
so the reduced gradient g of one optimizer step gives each token's weight in J exactly:

    g[i, t] = -A_i * w[i, t]      =>      w[i, t] = -(g(+A) - g(-A))[i, t] / (2 * A_i)

Running with both signs of the advantages cancels any gradient that does not scale with them (a
k1 KL, an entropy bonus); its size is kept as ``Result.residual``. No line of the loss is read.

``Convention`` is the outer loop around the loss; the splits beyond (W, A, sharding) are
``gradnorm.audit.splits``'s layouts; the loss is called as ``gradnorm.audit.contract`` says.
This module is pure (no torch.distributed, no processes).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import Tensor

from gradnorm.audit.contract import COUNTS, ContractError
from gradnorm.audit.splits import Layout, Loop, build
from gradnorm.audit.synthetic import SyntheticBatch
from gradnorm.cli.usercode import USER_EXITS, describe
from gradnorm.core.sharding import Plan, validate_plan
from gradnorm.core.simulate import simulated_counts


@dataclass(frozen=True)
class Convention:
    """The outer loop around the user's microbatch loss."""

    scale_by_accum: bool = False
    """Whether the trainer divides each microbatch's returned loss by A before backward."""
    reduction: str = "mean"
    """How gradients combine over ranks: "mean" (DDP, FSDP) or "sum"."""
    cp_reduction: str = "mean"
    """How gradients combine over the K ranks of a context-parallel group: "mean" or "sum"."""
    pipeline_combine: str = "sum"
    """How a pipeline schedule combines its P microbatches' losses: "sum" or "mean" (x 1/P)."""

    @property
    def loop(self) -> Loop:
        return Loop(self.scale_by_accum, self.reduction, self.cp_reduction, self.pipeline_combine)


PAD_LOGP = -1.0
"""The log-prob a packed row's padding holds (it belongs to no sequence and carries no advantage)."""


def _call(loss_fn, batch: SyntheticBatch, layout: Layout, advantages: Tensor) -> Tensor:
    """g (S*T + 1,): the reduced gradient of one optimizer step w.r.t. every token's logp (last: padding)."""
    S, T = batch.mask.shape
    counts = simulated_counts(layout.plan, batch.mask.sum(-1), batch.group_ids, batch.num_groups)
    kept_lengths = batch.mask.sum(-1)  # (S,) |o_i| counted
    values = torch.cat([batch.logp.reshape(-1), torch.tensor([PAD_LOGP], dtype=batch.logp.dtype)])
    response = torch.cat([batch.response.reshape(-1), torch.tensor([False])])
    rejected = torch.cat([batch.rejected.reshape(-1), torch.tensor([False])])
    packed = "pack" in layout.axes
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError) as err:
        raise ContractError(f"cannot read the loss's signature: {describe(err)}") from None
    grad = torch.zeros(S * T + 1, dtype=batch.logp.dtype)
    for call in layout.calls:  # every forward of the step: gradients add up
        seq = call.sequences  # (k,) minibatch indices
        leaf = values[call.index].clone().requires_grad_(True)  # (n, L) ALGO LOGIC: the leaf we read
        if packed:  # a packed row's advantages are per token: its sequence's, 0 on padding
            adv = torch.where(call.sequence >= 0, advantages[seq][call.sequence.clamp(min=0)], 0.0)  # (n, L)
        else:
            adv = advantages[seq]  # (n,)
        offered = {
            "ref_logp": leaf.detach().clone(), "num_tokens": counts.tokens, "num_sequences": counts.sequences,
            "num_groups": counts.active_groups, "group_tokens": counts.group_tokens[batch.group_ids[seq]],
            "group_ids": batch.group_ids[seq], "world_size": layout.world_size, "accum_steps": call.accum_steps,
            "sequence_ids": call.sequence, "sequence_tokens": kept_lengths[seq],
            "num_response_tokens": int(batch.response.sum()), "truncated": batch.truncated[seq],
            "rejected": rejected[call.index], "context_parallel": layout.context_parallel,
            "pipeline_microbatches": layout.pipeline_microbatches,
        }
        asked = {k: v for k, v in offered.items() if k in signature.parameters}
        where = f"(W={layout.world_size} {layout.label}, {call.where[1:]}"
        mask = response[call.index]
        try:
            signature.bind(leaf, leaf.detach().clone(), adv, mask, **asked)
        except TypeError as err:
            raise ContractError(f"the loss cannot take the audit's arguments ({err}); it gets logp, old_logp, "
                                f"advantages, mask and, by name, any of: {', '.join(COUNTS)}") from None
        try:
            loss = loss_fn(leaf, leaf.detach().clone(), adv, mask, **asked)
        except USER_EXITS as err:
            raise ContractError(f"the loss raised {describe(err)} {where}") from None
        if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            got = f"shape {tuple(loss.shape)} {loss.dtype}" if isinstance(loss, Tensor) else type(loss).__name__
            raise ContractError(f"the loss must return a scalar float tensor, got {got} {where}")
        if not torch.isfinite(loss).all():
            raise ContractError(f"the loss returned {loss.item()} {where}")
        if not loss.requires_grad:
            raise ContractError(f"the loss is not differentiable in logp (no gradient) {where}")
        try:
            (g,) = torch.autograd.grad(loss.reshape(()) * call.scale, leaf, allow_unused=True)  # loop, reductions
        except RuntimeError as err:
            raise ContractError(f"backward through the loss failed: {describe(err)} {where}") from None
        if g is None:
            raise ContractError(f"the loss is not differentiable in logp (no gradient) {where}")
        if not torch.isfinite(g).all():
            raise ContractError(f"the loss has a NaN or inf gradient {where}")
        grad.index_add_(0, call.index.reshape(-1), g.reshape(-1))
    return grad


@dataclass
class Result:
    """The weights of one configuration, and each rank's share of the update."""

    label: str
    plan: Plan
    weights: Tensor  # (S, T) float64: w[i, t], the token's weight in J (0 where the loss ignores it)
    residual: Tensor  # (S, T): the gradient part that does not scale with the advantages
    change: float = 0.0  # the largest relative change of a token's weight against the reference
    update_share: Tensor = field(default=None)  # (W*K,) each rank's share of sum w
    token_share: Tensor = field(default=None)  # (W*K,) each rank's share of the response tokens
    distance: dict[str, float] = field(default_factory=dict)  # mode -> max |w - w_mode| / max |w_mode|
    factor: dict[str, float] = field(default_factory=dict)  # mode -> c, when w = c * w_mode to tol (else absent)
    layout: Layout | None = None  # every call of the step (the axes beyond the plan)

    @property
    def world_size(self) -> int:
        return len(self.plan)

    @property
    def accum_steps(self) -> int:
        return len(self.plan[0])

    @property
    def axes(self) -> frozenset[str]:
        """The splits beyond a fixed-count plan this configuration has: "budget", "pack", "cp", "pipeline"."""
        return self.layout.axes if self.layout else frozenset()

    @property
    def accum_label(self) -> str:
        """A, or its range over the ranks when a token budget gives them different counts ("3-5")."""
        counts = [len(rank) for rank in self.plan]
        return str(counts[0]) if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}"

    @property
    def equal_counts(self) -> bool:
        """Every microbatch holds the same number of sequences (fixed-size microbatches)."""
        return len({len(mb) for rank in self.plan for mb in rank}) == 1


def measure(loss_fn, batch: SyntheticBatch, plan: Plan | Layout, convention: Convention = Convention(),
            label: str = "") -> Result:
    """The effective weight w[i, t] of every token of ``batch`` under ``plan`` (see the module docstring).

    ``plan``: a fixed-count plan of ``gradnorm.core.sharding``, or a ``splits.Layout`` (any axis).
    """
    S, T = batch.mask.shape
    if isinstance(plan, Layout):
        layout = plan
        label = label or layout.label
    else:
        validate_plan(plan, S)
        layout = build(label, plan, batch.response.sum(-1), T, convention.loop)
    plus = _call(loss_fn, batch, layout, batch.advantages)
    minus = _call(loss_fn, batch, layout, -batch.advantages)
    adv = batch.advantages.unsqueeze(-1)  # (S, 1)
    weights = -(plus - minus)[: S * T].reshape(S, T) / (2 * adv)  # a packed row's padding dropped
    owner = torch.zeros(S * T + 1, dtype=torch.long)  # the rank that holds each position
    for call in layout.calls:
        owner[call.index.reshape(-1)] = call.rank
    owner = owner[: S * T]
    total = weights.sum()
    flat, counted = weights.reshape(-1), batch.mask.reshape(-1)
    ranks = range(layout.num_ranks)
    update = torch.stack([flat[owner == r].sum() for r in ranks]) / (total if total != 0 else 1.0)
    tokens = torch.stack([counted[owner == r].sum() for r in ranks]).double() / batch.mask.sum()
    return Result(label, layout.plan, weights, (plus + minus)[: S * T].reshape(S, T) / 2, update_share=update,
                  token_share=tokens, layout=layout)
