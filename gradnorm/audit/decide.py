"""Deciding what a loss does: its weights under every configuration against the reference and the modes.

``audit`` measures a loss under every (W, A, sharding) and split asked for (``measurement``) on
the synthetic minibatch (``synthetic``), and a ``Report`` compares each with the reference (one
process, one microbatch) and with gradnorm's modes. It says whether the weights are invariant,
which mode they equal, and, when a loss fails, why:

    wrong sign      some w[i, t] < 0 with M[i, t] = 1: the loss rises where A_i > 0
    up to a factor  w = c * w_mode under every configuration, c = k * W^p * A^q (``Near``)
    unequal counts  invariant on every plan whose microbatches hold equal numbers of sequences,
                    skewed on a plan whose microbatches do not (``balanced`` packs by tokens)

and it refuses (``ContractError``) a run whose only configuration is the reference. The words
of the verdict are ``gradnorm.audit.verdict``'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradnorm.audit.contract import ContractError
from gradnorm.audit.masking import MaskedFinding, with_masked_tokens
from gradnorm.audit.masking import finding as masked_finding
from gradnorm.audit.measurement import Convention, Result, measure
from gradnorm.audit.splits import Splits, layouts
from gradnorm.audit.synthetic import SyntheticBatch, minibatch_size, synthetic_minibatch
from gradnorm.core.modes import MODE_NAMES
from gradnorm.core.sharding import SHARD_KINDS, Plan
from gradnorm.core.simulate import effective_weights

MODES = MODE_NAMES  # compared in this order: the core's modes, then Dr GRPO's constant


@dataclass(frozen=True)
class Near:
    """The mode a loss equals up to one uniform factor per configuration: w = k * W^p * A^q * w_mode.

    Under each configuration every token's weight is the same multiple c of the mode's weight; c
    changes with (W, A) as W^p * A^q, k being c under the reference. ``powers`` holds every (p, q)
    with |p|, |q| <= 2 and the fewest |p| + |q| that fits each c to tol (two when W = A hides which),
    and is empty when none does.
    """

    mode: str
    scale: float  # k
    powers: tuple[tuple[int, int], ...]  # (p, q)
    factors: tuple[float, ...]  # c of each configuration, in the order of Report.results


@dataclass
class Report:
    """The audit of one loss: its weights under every configuration, and the verdict."""

    name: str
    batch: SyntheticBatch
    convention: Convention
    results: list[Result]  # results[0] is the reference: one process, one microbatch
    distance: dict[str, float]  # mode -> max |w - w_mode| / max |w_mode| over every configuration
    constant: float  # C fitted to the reference: N / sum w (inf when sum w <= 0)
    change: float  # the largest relative change of any token's weight across configurations
    leak: float  # the largest share of |w| on tokens outside the mask
    residual: float  # max |gradient not scaling with A| / max |A * w|, the surrogate's gradient
    tol: float
    negative: float = 0.0  # the largest share of the weight inside the mask that is negative
    near: Near | None = None  # when no mode matches: the one it equals up to a factor, if any
    masked: MaskedFinding | None = None  # with dropped tokens in the batch: what the denominator does with them

    @property
    def matches(self) -> list[str]:
        return [m for m in MODES if self.distance[m] <= self.tol]

    @property
    def equals(self) -> str | None:
        """The first gradnorm mode whose weights these are, under every configuration, or None."""
        return self.matches[0] if self.matches else None

    @property
    def invariant(self) -> bool:
        """Every token's weight is the same under every configuration, to ``tol``."""
        return self.change <= self.tol

    @property
    def leaks(self) -> bool:
        """Some weight falls on tokens outside the mask (padding, prompt)."""
        return self.leak > self.tol

    @property
    def wrong_sign(self) -> bool:
        """Some response token has a negative weight: the loss rises where the advantage is positive."""
        return self.negative > self.tol

    def _changes(self, equal: bool) -> list[float]:
        # results[0], the reference, is one microbatch: equal counts trivially, and no change by definition.
        return [r.change for r in self.results[1:] if r.equal_counts == equal]

    @property
    def skewed_only_by_unequal_counts(self) -> bool:
        """Invariant on every plan with equal-count microbatches (at least one), skewed on another."""
        even, uneven = self._changes(True), self._changes(False)
        return bool(even) and max(even) <= self.tol and bool(uneven) and max(uneven) > self.tol

    @property
    def equals_at_equal_counts(self) -> str | None:
        """The first mode matched on the reference and every plan with equal-count microbatches."""
        even = [r for r in self.results if r.equal_counts]
        return next((m for m in MODES if max(r.distance[m] for r in even) <= self.tol), None)

    @property
    def exit_code(self) -> int:
        """The command's status: 0 invariant, masked and signed right; 1 skewed, leaking or wrong-signed."""
        miscounts = self.masked is not None and self.masked.counts_dropped is True
        return 0 if self.invariant and not self.leaks and not self.wrong_sign and not miscounts else 1


def _mode_weights(mode: str, mask: Tensor, batch: SyntheticBatch, plan: Plan, constant: float) -> Tensor:
    """(S, T) the weights gradnorm's ``mode`` gives under ``plan``, counting ``mask``; ``constant`` uses C.

    Only ``local`` depends on the plan: 1 / (W * A_r * N[r, m]), written out here because a token
    budget gives ranks different numbers A_r of microbatches (core's plans have one A). The other
    modes' weights are the same under any plan, so they come from core's one-process plan.
    """
    if mode != "local":
        den = constant if mode == "constant" else mode
        return effective_weights(mask, batch.group_ids, batch.num_groups, den, [[torch.arange(len(mask))]])
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for rank in plan:
        for mb in rank:
            local_tokens = int(mask[mb].sum())
            if local_tokens:
                out[mb] = mask[mb].double() / (len(plan) * len(rank) * local_tokens)
    return out


def _fit(weights: Tensor, expected: Tensor, tol: float) -> float | None:
    """c when w = c * w_mode to tol (least squares: c = <w, e> / <e, e>), else None."""
    norm = float((expected * expected).sum())
    c = float((weights * expected).sum()) / norm if norm > 0 else 0.0
    if c == 0 or (weights - c * expected).abs().max() > tol * abs(c) * expected.abs().max():
        return None
    return c


def _powers(factors: Sequence[float], results: Sequence[Result], tol: float) -> tuple[tuple[int, int], ...]:
    """Every (p, q) of the fewest |p| + |q| with c = k * W^p * A^q for one k over all configurations."""
    fits = []
    for p in range(-2, 3):
        for q in range(-2, 3):
            ks = [c / (r.world_size ** p * r.accum_steps ** q) for c, r in zip(factors, results)]
            if all(abs(k - ks[0]) <= tol * abs(ks[0]) for k in ks):
                fits.append((abs(p) + abs(q), (p, q)))
    fewest = min((n for n, _ in fits), default=None)
    return tuple(pq for n, pq in fits if n == fewest)


def _nearest(results: Sequence[Result], tol: float) -> Near | None:
    """The mode the weights equal up to a factor, preferring k = +-1 and a law in W and A."""
    near = []
    for mode in MODES:
        factors = [r.factor.get(mode) for r in results]
        if None not in factors:
            powers = _powers(factors, results, tol)
            p, q = powers[0] if powers else (0, 0)
            k = factors[0] / (results[0].world_size ** p * results[0].accum_steps ** q)  # c at W = A = 1
            near.append(Near(mode, k, powers, tuple(factors)))
    preference = [(not n.powers, abs(abs(n.scale) - 1) > tol, MODES.index(n.mode)) for n in near]
    return near[preference.index(min(preference))] if near else None


def _negative_share(weights: Tensor, mask: Tensor) -> float:
    """sum of |w| over response tokens with w < 0, over sum of |w| on response tokens (0 when all are 0).

    A negative weight means minimizing the loss lowers the token's log-prob where its advantage is
    positive (w = -g / A_i): the sign of a returned objective, or of logp and old_logp swapped.
    """
    inside = weights[mask]
    total = float(inside.abs().sum())
    return float(inside.clamp(max=0).abs().sum()) / total if total > 0 else 0.0


def audit_plans(loss_fn, batch: SyntheticBatch, plans: dict[str, Plan] | Sequence[tuple[str, Plan]],
                convention: Convention = Convention(), name: str = "loss", tol: float = 1e-6) -> Report:
    """Audit ``loss_fn`` under every (label, plan); the first is the reference the others are compared with."""
    pairs = list(plans.items() if isinstance(plans, dict) else plans)
    if len(pairs) < 2:  # a reference alone: every verdict would be vacuously INVARIANT
        raise ContractError("nothing to compare: only one process with one microbatch was asked for; "
                            "give a world size or accumulation steps above 1")
    results = [measure(loss_fn, batch, plan, convention, label) for label, plan in pairs]
    cache: dict[str, Tensor] = {}  # every mode but `local` gives the same weights under any plan
    ref = results[0].weights
    scale = ref.abs().max()
    if scale == 0:
        raise ContractError("the loss has zero gradient in logp: no token has any weight")
    floor = torch.where(ref.abs() > 1e-12 * scale, ref.abs(), scale)  # relative per token, w = 0 against the largest
    for res in results:
        res.change = float(((res.weights - ref).abs() / floor).max())
    inside = float(ref[batch.mask].sum())
    constant = float(batch.mask.sum()) / inside if inside > 0 else math.inf  # C = N / sum w: 1/C per token
    for res in results:
        for mode in MODES:
            if mode == "constant" and not math.isfinite(constant):
                res.distance[mode] = math.inf
                continue
            if mode == "local":
                expected = _mode_weights(mode, batch.mask, batch, res.plan, constant)  # (S, T)
            else:
                expected = cache.get(mode)
                if expected is None:
                    expected = cache[mode] = _mode_weights(mode, batch.mask, batch, res.plan, constant)
            res.distance[mode] = float((res.weights - expected).abs().max() / expected.abs().max())
            if (c := _fit(res.weights, expected, tol)) is not None:
                res.factor[mode] = c
    distance = {mode: max(r.distance[mode] for r in results) for mode in MODES}
    leak = max(float(r.weights[~batch.mask].abs().sum() / r.weights.abs().sum()) for r in results)
    negative = max(_negative_share(r.weights, batch.mask) for r in results)
    adv = batch.advantages.unsqueeze(-1)  # (S, 1)
    residual = max(float(r.residual.abs().max()) for r in results) / max(
        float((r.weights * adv).abs().max()) for r in results)
    report = Report(name, batch, convention, results, distance, constant, max(r.change for r in results), leak,
                    residual, tol, negative)
    if report.equals is None:
        report.near = _nearest(results, tol)
    if batch.count_masked is not None:  # right: counts over the kept tokens; counting: over every generated one
        modes = [m for m in MODES if m not in ("local", "constant")]
        right = {m: cache[m] for m in modes}
        counting = {m: _mode_weights(m, batch.response, batch, results[0].plan, constant) * batch.mask for m in modes}
        report.masked = masked_finding(batch, results[0].weights, right, counting, tol)
    return report


def audit(loss_fn, world_sizes: Sequence[int] = (8,), accum_steps: Sequence[int] = (4,),
          shardings: Sequence[str] = SHARD_KINDS, convention: Convention = Convention(), group_size: int = 8,
          max_new_tokens: int = 64, seed: int = 0, name: str | None = None, tol: float = 1e-6,
          splits: Splits = Splits(), count_masked: str | None = None) -> Report:
    """Audit ``loss_fn`` for every (W, A, sharding) and split asked for, against one process with one microbatch.

    ``splits``: the axes beyond (W, A, sharding) (``gradnorm.audit.splits``); ``count_masked``: add
    truncated responses and rejected tokens, and declare which the loss should count
    (``gradnorm.audit.masking``). W = A = 1 with no axis is the reference itself; asking for
    nothing else is a ``ContractError``.
    """
    sizes = [w * a * splits.granularity for w in world_sizes for a in accum_steps]
    batch = synthetic_minibatch(minibatch_size(sizes, group_size), group_size, max_new_tokens, seed)
    if count_masked is not None:
        batch = with_masked_tokens(batch, count_masked, seed)
    try:
        pairs = [(layout.label, layout) for layout in
                 layouts(batch.response.sum(-1), max_new_tokens, world_sizes, accum_steps, shardings, splits,
                         convention.loop)]
    except ValueError as err:  # a split the minibatch cannot take (a budget below the longest response)
        raise ContractError(str(err)) from None
    return audit_plans(loss_fn, batch, pairs, convention, name or getattr(loss_fn, "__name__", "loss"), tol)
