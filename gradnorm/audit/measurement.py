"""Measuring a loss: its per-token weights under one layout, read off the gradient.

Method. The per-token log-probs are a leaf tensor. The user's microbatch loss runs under a
simulated (W, A, sharding): the trainer's accumulation convention (backward as returned, or
divided by A), gradients added over a rank's microbatches, then DDP's mean (or sum) over ranks,
the arithmetic of ``gradnorm.core.simulate``. At a point where each token's loss has a known
slope a_i (``gradnorm.audit.objectives``), the reduced gradient g of one optimizer step gives
each token's weight in J exactly. For GRPO, on policy (old_logp = ref_logp = logp, so rho = 1,
the clip is inactive and a k2/k3 KL has zero gradient), the surrogate -rho * A_i has slope A_i:

    g[i, t] = -A_i * w[i, t]      =>      w[i, t] = -(g(+A) - g(-A))[i, t] / (2 * A_i)

Running with both signs of the advantages cancels any gradient that does not scale with them (a
k1 KL, an entropy bonus); its size is kept as ``Result.residual``. SFT's -log p has slope 1
everywhere, and DPO's pair loss -log sigmoid(beta * m) slope beta/2 on the chosen tokens and
-beta/2 on the rejected ones at pi = pi_ref: one call each, w = -g / a. No line of the loss is read.

Two forms: a microbatch loss (``_call``), which may return a dict of named terms (each read as
the total is), and a rank's step (``_call_step``), which runs its own loop over the microbatches
and calls backward itself, so the loop's own scaling is measured as it runs.

``Convention`` is the outer loop around a microbatch loss; the splits beyond (W, A, sharding) are
``gradnorm.audit.splits``'s layouts; the loss is called as ``gradnorm.audit.contract`` says.
This module is pure (no torch.distributed, no processes).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import Tensor

from gradnorm.audit.contract import ContractError
from gradnorm.audit.objectives import DEFAULT_BETA, GRPO, Objective, slopes
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
    measured: bool = False
    """The loop was not declared but run: a real trainer's, read by the trainer audit. Its verdict speaks
    of the trainer and offers no flag to declare another loop."""

    @property
    def loop(self) -> Loop:
        return Loop(self.scale_by_accum, self.reduction, self.cp_reduction, self.pipeline_combine)


LOSS_EXITS = (*USER_EXITS, GeneratorExit)
"""What a loss or step may raise that is its failure: a GeneratorExit too (a BaseException, as a
generator's close() raises it), which would otherwise read as the audit's own failure."""

PAD_LOGP = -1.0
"""The log-prob a packed row's padding holds (it belongs to no sequence and carries no advantage)."""
KL_OFFSET = 0.1
"""ref_logp = logp - KL_OFFSET for a GRPO loss that names its terms, so that a KL term has a gradient."""


@dataclass(frozen=True)
class Point:
    """Where one optimizer step is evaluated: the objective, its beta, and the loss's form."""

    objective: Objective = GRPO
    beta: float = DEFAULT_BETA  # DPO's temperature, offered as ``beta`` and used to read the weights
    step: bool = False  # the function is a rank's step over its microbatches, not one microbatch's loss
    ref_offset: float = 0.0  # GRPO: ref_logp = logp - ref_offset (KL_OFFSET when the loss names terms)


def _inputs(point: Point, batch: SyntheticBatch, layout: Layout, call, leaf: Tensor, advantages: Tensor,
            counts, response: Tensor, rejected: Tensor) -> tuple[tuple, dict]:
    """The positional arguments of one call of the loss, and every keyword the objective offers."""
    seq, kept_lengths = call.sequences, batch.mask.sum(-1)
    mask = response[call.index]
    split = {"world_size": layout.world_size, "accum_steps": call.accum_steps}
    if point.objective.name == "dpo":  # rows alternate chosen, rejected: pair j is rows 2j and 2j + 1
        ref = leaf.detach().clone()  # pi_ref = pi_theta: every margin is 0
        return ((leaf[0::2], leaf[1::2], ref[0::2], ref[1::2], mask[0::2], mask[1::2]),
                {"num_pairs": len(batch.mask) // 2, "num_tokens": counts.tokens, "beta": point.beta,
                 "chosen_tokens": kept_lengths[seq[0::2]], "rejected_tokens": kept_lengths[seq[1::2]], **split})
    common = {"num_tokens": counts.tokens, "num_sequences": counts.sequences, **split,
              "sequence_ids": call.sequence, "sequence_tokens": kept_lengths[seq],
              "context_parallel": layout.context_parallel, "pipeline_microbatches": layout.pipeline_microbatches}
    if point.objective.name == "sft":
        return (leaf, mask), common
    if "pack" in layout.axes:  # a packed row's advantages are per token: its sequence's, 0 on padding
        adv = torch.where(call.sequence >= 0, advantages[seq][call.sequence.clamp(min=0)], 0.0)  # (n, L)
    else:
        adv = advantages[seq]  # (n,)
    return (leaf, leaf.detach().clone(), adv, mask), {
        **common, "ref_logp": leaf.detach() - point.ref_offset, "num_groups": counts.active_groups,
        "group_tokens": counts.group_tokens[batch.group_ids[seq]], "group_ids": batch.group_ids[seq],
        "num_response_tokens": int(batch.response.sum()), "truncated": batch.truncated[seq],
        "rejected": rejected[call.index]}


def _asked(offered: dict, signature: inspect.Signature) -> dict:
    """The offered keywords the loss takes: those it names, or all of them when it takes ``**kwargs``
    (a loss written as ``loss(logp, ..., **counts)`` reads its counts from there)."""
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return dict(offered)
    return {k: v for k, v in offered.items() if k in signature.parameters}


def _signature(fn) -> inspect.Signature:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError) as err:
        raise ContractError(f"cannot read the loss's signature: {describe(err)}") from None


def _terms(loss, where: str) -> dict[str | None, Tensor]:
    """The loss as {None: total} or, when it names its terms, {name: term} (the total is their sum)."""
    named = isinstance(loss, dict)
    terms = loss if named else {None: loss}
    if named and not terms:
        raise ContractError(f"the loss returned an empty dict of terms {where}")
    for name, term in terms.items():
        what = f"the loss's term {name!r}" if named else "the loss"
        if named and not isinstance(name, str):
            raise ContractError(f"the loss's terms must be named by strings, got {name!r} {where}")
        if not isinstance(term, Tensor) or term.numel() != 1 or not term.is_floating_point():
            got = f"shape {tuple(term.shape)} {term.dtype}" if isinstance(term, Tensor) else type(term).__name__
            raise ContractError(f"{what} must be a scalar float tensor, got {got} {where}")
        if not torch.isfinite(term).all():
            raise ContractError(f"{what + ' is' if named else 'the loss returned'} {term.item()} {where}")
    return terms


def _grad(term: Tensor, leaf: Tensor, scale: float, what: str, where: str, retain: bool) -> Tensor:
    if not term.requires_grad:
        raise ContractError(f"{what} is not differentiable in logp (no gradient) {where}")
    try:
        (g,) = torch.autograd.grad(term.reshape(()) * scale, leaf, allow_unused=True, retain_graph=retain)
    except RuntimeError as err:
        raise ContractError(f"backward through {what} failed: {describe(err)} {where}") from None
    if g is None:
        raise ContractError(f"{what} is not differentiable in logp (no gradient) {where}")
    if not torch.isfinite(g).all():
        raise ContractError(f"{what} has a NaN or inf gradient {where}")
    return g


def _call(loss_fn, batch: SyntheticBatch, layout: Layout, advantages: Tensor,
          point: Point = Point(), dtypes: set[torch.dtype] | None = None) -> dict[str | None, Tensor]:
    """g (S*T + 1,) per term: the reduced gradient of one optimizer step w.r.t. every token's logp (last: padding).

    The key None holds the total; a loss that names its terms adds one entry per term. ``dtypes``
    collects the dtype of every term the loss returned (a step returns none).
    """
    if point.step:
        return {None: _call_step(loss_fn, batch, layout, advantages, point)}
    S, T = batch.mask.shape
    counts = simulated_counts(layout.plan, batch.mask.sum(-1), batch.group_ids, batch.num_groups)
    values = torch.cat([batch.logp.reshape(-1), torch.tensor([PAD_LOGP], dtype=batch.logp.dtype)])
    response = torch.cat([batch.response.reshape(-1), torch.tensor([False])])
    rejected = torch.cat([batch.rejected.reshape(-1), torch.tensor([False])])
    signature = _signature(loss_fn)
    grads: dict[str | None, Tensor] = {}
    for call in layout.calls:  # every forward of the step: gradients add up
        leaf = values[call.index].clone().requires_grad_(True)  # (n, L) ALGO LOGIC: the leaf we read
        args, offered = _inputs(point, batch, layout, call, leaf, advantages, counts, response, rejected)
        asked = _asked(offered, signature)
        where = f"(W={layout.world_size} {layout.label}, {call.where[1:]}"
        try:
            signature.bind(*args, **asked)
        except TypeError as err:
            raise ContractError(f"the loss cannot take the audit's arguments ({err}){_step_hint(signature)}; "
                                f"{point.objective.describe()}") from None
        try:
            loss = loss_fn(*args, **asked)
        except LOSS_EXITS as err:
            raise ContractError(f"the loss raised {describe(err)} {where}") from None
        terms = _terms(loss, where)
        if dtypes is not None:
            dtypes.update(t.dtype for t in terms.values())
        named, before = set(terms) - {None}, set(grads) - {None}
        if grads and named != before:
            raise ContractError(f"the loss named terms {sorted(named)} here and {sorted(before)} before {where}: "
                                "every call must return the same terms")
        total = sum(terms.values()) if None not in terms else terms[None]
        parts = {None: total} | ({} if None in terms else terms)
        for k, (name, term) in enumerate(parts.items()):
            what = "the loss" if name is None else f"the loss's term {name!r}"
            g = _grad(term, leaf, call.scale, what, where, retain=k < len(parts) - 1)
            grads.setdefault(name, torch.zeros(S * T + 1, dtype=batch.logp.dtype))
            grads[name].index_add_(0, call.index.reshape(-1), g.reshape(-1))
    return grads


def _step_hint(signature: inspect.Signature) -> str:
    """A function whose first parameter is ``microbatches`` is a rank's step, audited with --step."""
    first = next(iter(signature.parameters), None)
    return (f": its first parameter is `{first}`, a rank's step? audit it with --step"
            if first == "microbatches" else "")


def names_terms(loss_fn, batch: SyntheticBatch, layout: Layout, point: Point) -> bool:
    """Whether the loss returns a dict of named terms (one step of ``layout``, the reference's)."""
    return len(_call(loss_fn, batch, layout, batch.advantages, point)) > 1


def _call_step(step_fn, batch: SyntheticBatch, layout: Layout, advantages: Tensor, point: Point) -> Tensor:
    """The user's step runs each rank's microbatches itself: it calls backward, scaled as its loop scales.

    ``step_fn(microbatches, **asked)``: ``microbatches`` a list of dicts, one per microbatch of the
    rank, each holding the objective's positional arguments and every offered count by name;
    ``asked`` any of ``world_size`` and ``rank``. Only the reduction over ranks is the audit's.
    """
    S, T = batch.mask.shape
    counts = simulated_counts(layout.plan, batch.mask.sum(-1), batch.group_ids, batch.num_groups)
    values = torch.cat([batch.logp.reshape(-1), torch.tensor([PAD_LOGP], dtype=batch.logp.dtype)])
    response = torch.cat([batch.response.reshape(-1), torch.tensor([False])])
    rejected = torch.cat([batch.rejected.reshape(-1), torch.tensor([False])])
    signature = _signature(step_fn)
    grad = torch.zeros(S * T + 1, dtype=batch.logp.dtype)
    for rank in range(layout.num_ranks):
        calls = [c for c in layout.calls if c.rank == rank]
        leaves, microbatches = [], []
        for call in calls:
            leaf = values[call.index].clone().requires_grad_(True)
            args, offered = _inputs(point, batch, layout, call, leaf, advantages, counts, response, rejected)
            leaves.append(leaf)
            microbatches.append(dict(zip(point.objective.arguments, args)) | offered)
        asked = _asked({"world_size": layout.world_size, "rank": rank}, signature)
        where = f"(W={layout.world_size} {layout.label}, rank {rank})"
        try:
            signature.bind(microbatches, **asked)
        except TypeError as err:
            raise ContractError(f"the step cannot take the audit's arguments ({err}); it gets the rank's "
                                "microbatches (a list of dicts) and, by name, world_size and rank") from None
        try:
            step_fn(microbatches, **asked)
        except LOSS_EXITS as err:
            raise ContractError(f"the step raised {describe(err)} {where}") from None
        if all(leaf.grad is None for leaf in leaves):
            raise ContractError(f"the step called no backward that reaches logp (no gradient) {where}")
        for call, leaf in zip(calls, leaves):
            if leaf.grad is not None:
                if not torch.isfinite(leaf.grad).all():
                    raise ContractError(f"the step left a NaN or inf gradient {where}")
                grad.index_add_(0, call.index.reshape(-1), leaf.grad.reshape(-1) * call.scale)  # the reduction's 1/W
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
    terms: dict[str, Tensor] = field(default_factory=dict)  # a loss that names its terms: each one's (S, T) weights
    dtype: torch.dtype | None = None  # the coarsest dtype the loss returned (None: a step, or weights read elsewhere)

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
        """Every microbatch holds the same number of sequences, or pairs (fixed-size microbatches)."""
        return len({len(mb) for rank in self.plan for mb in rank}) == 1


def _read(plus: Tensor, minus: Tensor | None, slope: Tensor, S: int, T: int,
          term: bool) -> tuple[Tensor, Tensor]:
    """(weights, residual) (S, T) from the step's gradients: w = -g / a, GRPO's from the part that flips with A.

    A named term of a GRPO loss that does not scale with the advantages (an NLL term, a KL, an
    entropy bonus) is read from the part that does not flip, with slope 1 (as an SFT term's, -log p,
    is): its weight is what the term would weigh each token's -log p with.
    """
    if minus is None:
        return -plus[: S * T].reshape(S, T) / slope, torch.zeros(S, T, dtype=plus.dtype)
    flips, stays = -(plus - minus)[: S * T].reshape(S, T) / (2 * slope), (plus + minus)[: S * T].reshape(S, T) / 2
    if term and float(stays.abs().max()) > float((flips * slope).abs().max()):
        return -stays, torch.zeros_like(stays)
    return flips, stays


def measure(loss_fn, batch: SyntheticBatch, plan: Plan | Layout, convention: Convention = Convention(),
            label: str = "", point: Point = Point()) -> Result:
    """The effective weight w[i, t] of every token of ``batch`` under ``plan`` (see the module docstring).

    ``plan``: a fixed-count plan of ``gradnorm.core.sharding``, or a ``splits.Layout`` (any axis).
    ``point``: the objective (``gradnorm.audit.objectives``) and the form of ``loss_fn``.
    """
    S, T = batch.mask.shape
    if isinstance(plan, Layout):
        layout = plan
        label = label or layout.label
    else:
        validate_plan(plan, S)
        layout = build(label, plan, batch.response.sum(-1), T, convention.loop)
    slope = slopes(point.objective, batch.advantages, point.beta).unsqueeze(-1)  # (S, 1)
    dtypes: set[torch.dtype] = set()
    plus = _call(loss_fn, batch, layout, batch.advantages, point, dtypes)
    minus = _call(loss_fn, batch, layout, -batch.advantages, point, dtypes) if point.objective.name == "grpo" else None
    if minus is not None and set(minus) != set(plus):
        raise ContractError(f"the loss named terms {sorted(set(plus) - {None})} with the advantages and "
                            f"{sorted(set(minus) - {None})} with their negatives: every call must return the same terms")
    weights, residual = _read(plus[None], None if minus is None else minus[None], slope, S, T, term=False)
    terms = {name: _read(plus[name], None if minus is None else minus[name], slope, S, T, term=True)[0]
             for name in plus if name is not None}
    owner = torch.zeros(S * T + 1, dtype=torch.long)  # the rank that holds each position
    for call in layout.calls:
        owner[call.index.reshape(-1)] = call.rank
    owner = owner[: S * T]
    total = weights.sum()
    flat, counted = weights.reshape(-1), batch.mask.reshape(-1)
    ranks = range(layout.num_ranks)
    update = torch.stack([flat[owner == r].sum() for r in ranks]) / (total if total != 0 else 1.0)
    tokens = torch.stack([counted[owner == r].sum() for r in ranks]).double() / batch.mask.sum()
    coarsest = max(dtypes, key=lambda d: torch.finfo(d).eps, default=None)
    return Result(label, layout.plan, weights, residual, update_share=update, token_share=tokens, layout=layout,
                  terms=terms, dtype=coarsest)
