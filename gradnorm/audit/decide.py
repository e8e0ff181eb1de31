"""Deciding what a loss does: its weights under every configuration against the reference and the modes.

``audit`` measures a loss under every (W, A, sharding) and split asked for (``measurement``) on
the synthetic minibatch (``synthetic``), and a ``Report`` compares each with the reference (one
process, one microbatch) and with gradnorm's modes. It says whether the weights are invariant,
which mode they equal, and, when a loss fails, why:

    wrong sign      some w[i, t] < 0 with M[i, t] = 1: the loss rises where A_i > 0
    up to a factor  w = c * w_mode under every configuration, c = k * W^p * A^q (``Near``)
    unequal counts  invariant on every plan whose microbatches hold equal numbers of sequences,
                    skewed on a plan whose microbatches do not (``balanced`` packs by tokens)

and it refuses (``ContractError``) a run whose only configuration is the reference. ``decide``
is the same comparison for weights read elsewhere (the trainer audit). What the report finds,
as data, is ``gradnorm.audit.diagnosis``'s; its words ``gradnorm.audit.verdict``'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from gradnorm.audit.contract import ContractError
from gradnorm.audit.masking import MaskedFinding, with_masked_tokens
from gradnorm.audit.masking import finding as masked_finding
from gradnorm.audit.measurement import (
    KL_OFFSET,
    Convention,
    Point,
    Result,
    measure,
    names_terms,
)
from gradnorm.audit.objectives import DEFAULT_BETA, GRPO, Objective, get, mode_weights
from gradnorm.audit.splits import Layout, Splits, build, layouts
from gradnorm.audit.synthetic import (
    SyntheticBatch,
    minibatch_size,
    synthetic_minibatch,
    synthetic_pairs,
)
from gradnorm.core.modes import MODE_NAMES
from gradnorm.core.sharding import SHARD_KINDS, Plan

MODES = MODE_NAMES  # GRPO's, compared in this order: the core's modes, then Dr GRPO's constant


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


@dataclass(frozen=True)
class Scaled:
    """An invariant loss whose every weight is ``times`` (an integer, 2 or more) what `token` gives.

    Fitted as a constant, C = N / times: the reference's total weight sum w is ``times`` where the
    right one is 1, the mark of a second backward per microbatch or a loss counted twice, not of a
    Dr GRPO constant (which a trainer sets from its lengths, C >= N). C = 1, a plain token sum, is
    the convention of its own it names, and not read as a scale.
    """

    times: int
    constant: float  # C = N / times


@dataclass(frozen=True)
class PerRankCount:
    """Each rank divides by its own count of ``mode``'s unit: rank r's weights are c_r times the mode's,
    with c_r * (rank r's share of the units) the same on every rank of a configuration (``per_rank``:
    1/W under DDP's mean, c_r = N / (W * N_r) for tokens). What transformers' Trainer does with
    ``average_tokens_across_devices`` off, and a rank's own token share: a rank-local mean."""

    mode: str  # "token", "sequence" or "pair"
    per_rank: tuple[float, ...]  # c_r * share_r of each configuration (the reference's is 1)


ROUNDING = (("float16 or bfloat16", 2 * 2.0**-11), ("bfloat16", 2 * 2.0**-8))
"""How far a 16-bit float's rounding moves a weight (two unit roundoffs: a weight is rounded once or
twice on its way through the loss), narrowest first: within float16's either dtype may have done it
(bfloat16 rounds some numbers by less), beyond it only bfloat16."""


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
    objective: Objective = GRPO
    terms: dict[str, Report] = field(default_factory=dict)  # a loss that names its terms: each one's audit
    term: bool = False  # this report is one term of a composite loss (its sign is the term's own)
    point: Point = Point()  # the objective's point (beta) and the loss's form (a step or a microbatch loss)
    scaled: Scaled | None = None  # invariant, but every weight a whole number of times `token`'s
    per_rank_count: PerRankCount | None = None  # equals no mode: each rank divides by its own count

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes this objective's weights are compared with, in order of preference.

        A term's coefficient scales it (0.1 x an NLL), so a term is compared with the modes up to a
        factor, and not with a constant C, which any uniform weight would fit.
        """
        return _modes(self.objective, self.term)

    @property
    def matches(self) -> list[str]:
        return [m for m in self.modes if self.distance[m] <= self.tol]

    @property
    def equals(self) -> str | None:
        """The first gradnorm mode whose weights these are, under every configuration, or None."""
        return self.matches[0] if self.matches else None

    @property
    def rounded(self) -> tuple[str, str] | None:
        """(mode, dtype): an invariant loss that equals a constant (or no mode) only because its
        weights are a mode's rounded to a 16-bit float, e.g. a float16 token mean, whose uniform
        weights fp16(1/N) fit some C near N. The dtype is the narrowest whose rounding explains the
        distance (``ROUNDING``); None when no mode is that close, or when the loss matches a mode outright."""
        if not self.invariant or self.equals not in (None, "constant"):
            return None
        close = [(self.distance[m], m) for m in self.modes if m != "constant" and math.isfinite(self.distance[m])]
        if not close:
            return None
        gap, mode = min(close)
        return next(((mode, name) for name, bound in ROUNDING if gap <= bound), None)

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
        return self.negative > self.tol and not self.term

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
        return next((m for m in self.modes if max(r.distance[m] for r in even) <= self.tol), None)

    @property
    def exit_code(self) -> int:
        """The command's status: 0 invariant, masked and signed right; 1 skewed, leaking or wrong-signed."""
        miscounts = self.masked is not None and self.masked.counts_dropped is True
        terms_fail = any(t.exit_code for t in self.terms.values())
        ok = self.invariant and not self.leaks and not self.wrong_sign and not miscounts and self.scaled is None
        return 0 if ok and not terms_fail else 1

    @property
    def loudness_by_result(self) -> list[float]:
        """Each configuration's total weight over the reference's (one process): 1 for a term weighed right."""
        base = float(self.results[0].weights.sum())
        return [float(r.weights.sum()) / base if base else math.inf for r in self.results[1:]]

    @property
    def loudness(self) -> tuple[float, Result]:
        """(how many times its one-process total weight, where it is furthest from 1) over every configuration.

        A term 32x too loud under A = 32 reads 32; a term that is correct, 1.
        """
        def distance(ratio: float) -> float:
            return abs(math.log(abs(ratio))) if ratio and math.isfinite(ratio) else math.inf
        return max(zip(self.loudness_by_result, self.results[1:]), key=lambda pair: distance(pair[0]))


def _modes(objective: Objective, term: bool) -> tuple[str, ...]:
    return tuple(m for m in objective.modes if not (term and m == "constant"))


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


def _nearest(results: Sequence[Result], tol: float, modes: Sequence[str] = MODES) -> Near | None:
    """The mode the weights equal up to a factor, preferring k = +-1 and a law in W and A."""
    near = []
    for mode in modes:
        factors = [r.factor.get(mode) for r in results]
        if None not in factors:
            powers = _powers(factors, results, tol)
            p, q = powers[0] if powers else (0, 0)
            k = factors[0] / (results[0].world_size ** p * results[0].accum_steps ** q)  # c at W = A = 1
            near.append(Near(mode, k, powers, tuple(factors)))
    preference = [(not n.powers, abs(abs(n.scale) - 1) > tol, list(modes).index(n.mode)) for n in near]
    return near[preference.index(min(preference))] if near else None


def _negative_share(weights: Tensor, mask: Tensor) -> float:
    """sum of |w| over response tokens with w < 0, over sum of |w| on response tokens (0 when all are 0).

    A negative weight means minimizing the loss lowers the token's log-prob where its advantage is
    positive (w = -g / A_i): the sign of a returned objective, or of logp and old_logp swapped.
    """
    inside = weights[mask]
    total = float(inside.abs().sum())
    return float(inside.clamp(max=0).abs().sum()) / total if total > 0 else 0.0


def audit_plans(loss_fn, batch: SyntheticBatch, plans: dict[str, Plan] | Sequence[tuple[str, Plan | Layout]],
                convention: Convention = Convention(), name: str = "loss", tol: float = 1e-6,
                point: Point = Point()) -> Report:
    """Audit ``loss_fn`` under every (label, plan); the first is the reference the others are compared with."""
    pairs = list(plans.items() if isinstance(plans, dict) else plans)
    if len(pairs) < 2:  # a reference alone: every verdict would be vacuously INVARIANT
        raise ContractError("nothing to compare: only one process with one microbatch was asked for; "
                            "give a world size or accumulation steps above 1")
    if point.objective.name == "grpo" and not point.step and point.ref_offset == 0:
        label, reference = pairs[0]
        if not isinstance(reference, Layout):
            reference = build(label, reference, batch.response.sum(-1), batch.mask.shape[1], convention.loop)
        if names_terms(loss_fn, batch, reference, point):
            point = replace(point, ref_offset=KL_OFFSET)  # give a KL term a gradient to read
    results = [measure(loss_fn, batch, plan, convention, label, point) for label, plan in pairs]
    report = _decide(name, batch, convention, results, tol, point, term=False)
    for term in results[0].terms:
        parts = [replace(r, weights=r.terms[term], residual=torch.zeros_like(r.weights), terms={},
                         distance={}, factor={}) for r in results]
        report.terms[term] = _decide(term, batch, convention, parts, tol, point, term=True)
    return report


def decide(name: str, batch: SyntheticBatch, results: list[Result], *, objective: str | Objective = "grpo",
           tol: float = 1e-6, convention: Convention = Convention(), beta: float = DEFAULT_BETA,
           step: bool = False) -> Report:
    """The loss audit's report of weights measured elsewhere: the public entry for a caller that reads
    per-token weights itself (the trainer audit) and wants the same report as ``audit``.

    ``batch``: the ``SyntheticBatch`` the weights were read on (mask (S, T) bool, advantages (S,),
    group_ids (S,), group_size); ``results``: one ``measurement.Result`` per configuration, the
    first the reference (one process, one microbatch), each with its label, plan (per rank, per
    microbatch, the sequence indices), weights (S, T) float64, residual (zeros when none was
    read), update_share and token_share (W,); ``objective``: "grpo", "sft" or "dpo" (or an
    ``Objective``); ``beta``: the DPO temperature the weights were read with; ``step``: the weights
    came from a rank's step rather than a microbatch loss; ``convention``: the loop around the loss.
    Words: ``gradnorm.audit.verdict.format_report(report)``; status: ``report.exit_code``.
    """
    point = Point(objective if isinstance(objective, Objective) else _objective(objective), beta, step)
    return _decide(name, batch, convention, results, tol, point, term=False)


def _decide(name: str, batch: SyntheticBatch, convention: Convention, results: list[Result], tol: float,
            point: Point, term: bool) -> Report:
    """The report of one set of weights (a loss's, or one of its terms') against the reference and the modes."""
    objective = point.objective
    modes = _modes(objective, term)
    cache: dict[str, Tensor] = {}  # every mode but the local ones gives the same weights under any plan
    ref = results[0].weights
    scale = ref.abs().max()
    if scale == 0:
        what = f"the loss's term {name!r}" if term else "the loss"
        raise ContractError(f"{what} has zero gradient in logp: no token has any weight")
    floor = torch.where(ref.abs() > 1e-12 * scale, ref.abs(), scale)  # relative per token, w = 0 against the largest
    for res in results:
        res.change = float(((res.weights - ref).abs() / floor).max())
    inside = float(ref[batch.mask].sum())
    constant = float(batch.mask.sum()) / inside if inside > 0 else math.inf  # C = N / sum w: 1/C per token
    for res in results:
        for mode in modes:
            if mode == "constant" and not math.isfinite(constant):
                res.distance[mode] = math.inf
                continue
            expected = cache.get(mode)
            if expected is None:
                expected = mode_weights(objective, mode, batch.mask, batch.group_ids, batch.num_groups, res.plan,
                                        constant)
                if not mode.startswith("local"):
                    cache[mode] = expected
            res.distance[mode] = float((res.weights - expected).abs().max() / expected.abs().max())
            if (c := _fit(res.weights, expected, tol)) is not None:
                res.factor[mode] = c
    distance = {mode: max(r.distance[mode] for r in results) for mode in modes}
    leak = max(float(r.weights[~batch.mask].abs().sum() / r.weights.abs().sum()) for r in results)
    negative = max(_negative_share(r.weights, batch.mask) for r in results)
    adv = batch.advantages.unsqueeze(-1)  # (S, 1)
    residual = max(float(r.residual.abs().max()) for r in results) / max(
        float((r.weights * adv).abs().max()) for r in results)
    report = Report(name, batch, convention, results, distance, constant, max(r.change for r in results), leak,
                    residual, tol, negative, objective=objective, term=term, point=point)
    if report.equals is None:
        report.near = _nearest(results, tol, modes)
        if not term:
            report.per_rank_count = _per_rank_count(batch, results, cache, tol)
    if report.equals == "constant" and not term:
        report.scaled = _scaled(float(batch.mask.sum()), constant, tol)
    if batch.count_masked is not None and not term:  # right: counts over the kept tokens; counting: every generated one
        masked_modes = [m for m in modes if m not in ("local", "constant")]
        right = {m: cache[m] for m in masked_modes}
        counting = {m: mode_weights(objective, m, batch.response, batch.group_ids, batch.num_groups,
                                    results[0].plan, constant) * batch.mask for m in masked_modes}
        report.masked = masked_finding(batch, results[0].weights, right, counting, tol)
    return report


def _scaled(tokens: float, constant: float, tol: float) -> Scaled | None:
    """``Scaled`` when the fitted C is N / k for a whole k >= 2, with C > 1 (C = 1 is a token sum)."""
    times = tokens / constant  # the reference's total weight: 1 for `token`
    k = round(times)
    if k >= 2 and abs(times - k) <= tol * times and constant > 1:
        return Scaled(k, constant)
    return None


def _per_rank_count(batch: SyntheticBatch, results: Sequence[Result], cache: dict[str, Tensor],
                    tol: float) -> PerRankCount | None:
    """``PerRankCount`` for the first of `token`, `sequence`, `pair` that explains every configuration.

    Rank r's counted tokens must weigh one c_r times the mode's weight, with c_r * share_r (its share
    of the mode's units: tokens, or sequences and pairs by rows) one number over the ranks, and some
    configuration must give its ranks different c_r, or nothing told this apart from the mode itself.
    Context-parallel and pipeline ranks are not the plan's ranks: their configurations are not read.
    """
    if any(r.axes & {"cp", "pipeline"} for r in results):
        return None
    mask = batch.mask
    for mode in ("token", "sequence", "pair"):
        expected = cache.get(mode)
        if expected is None:
            continue
        per_rank, differ = [], False
        for result in results:
            rows = [torch.cat([torch.as_tensor(mb, dtype=torch.long) for mb in rank]) for rank in result.plan]
            units = [float(mask[r].sum()) if mode == "token" else float(len(r)) for r in rows]
            factors, products = [], []
            for r, n in zip(rows, units):
                got, want = result.weights[r][mask[r]], expected[r][mask[r]]
                if len(got) == 0:
                    continue
                ratio = got / want
                if not _near(float(ratio.max()), float(ratio.min()), tol):
                    break
                factors.append(float(ratio.mean()))
                products.append(factors[-1] * n / sum(units))
            else:
                if products and all(_near(x, products[0], tol) for x in products):
                    per_rank.append(products[0])
                    differ |= not all(_near(c, factors[0], tol) for c in factors)
                    continue
            break
        else:
            if differ:
                return PerRankCount(mode, tuple(per_rank))
    return None


def _near(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol * max(abs(a), abs(b))


def audit(loss_fn, world_sizes: Sequence[int] = (8,), accum_steps: Sequence[int] = (4,),
          shardings: Sequence[str] = SHARD_KINDS, convention: Convention = Convention(), group_size: int = 8,
          max_new_tokens: int = 64, seed: int = 0, name: str | None = None, tol: float = 1e-6,
          splits: Splits = Splits(), count_masked: str | None = None, objective: str | Objective = "grpo",
          beta: float = DEFAULT_BETA, step: bool = False) -> Report:
    """Audit ``loss_fn`` for every (W, A, sharding) and split asked for, against one process with one microbatch.

    ``objective``: "grpo", "sft" or "dpo" (``gradnorm.audit.objectives``: what the loss is called
    with, and the modes it is compared with); ``beta``: the temperature a DPO loss is read with;
    ``step``: ``loss_fn`` is a rank's step over its microbatches that calls backward itself
    (``gradnorm.audit.measurement``). ``splits``: the axes beyond (W, A, sharding)
    (``gradnorm.audit.splits``); ``count_masked`` (GRPO): add truncated responses and rejected
    tokens, and declare which the loss should count (``gradnorm.audit.masking``). W = A = 1 with
    no axis is the reference itself; asking for nothing else is a ``ContractError``.
    """
    objective = objective if isinstance(objective, Objective) else _objective(objective)
    _check_request(objective, splits, convention, count_masked, beta, step)
    sizes = [w * a * splits.granularity for w in world_sizes for a in accum_steps]
    if objective.name == "dpo":
        batch = synthetic_pairs(minibatch_size(sizes, 1), max_new_tokens, seed)
    else:
        batch = synthetic_minibatch(minibatch_size(sizes, group_size), group_size, max_new_tokens, seed)
    if count_masked is not None:
        batch = with_masked_tokens(batch, count_masked, seed)
    try:
        pairs = [(layout.label, layout) for layout in
                 layouts(batch.response.sum(-1), max_new_tokens, world_sizes, accum_steps, shardings, splits,
                         convention.loop, unit_size=objective.unit_size)]
    except ValueError as err:  # a split the minibatch cannot take (a budget below the longest response)
        raise ContractError(str(err)) from None
    return audit_plans(loss_fn, batch, pairs, convention, name or getattr(loss_fn, "__name__", "loss"), tol,
                       Point(objective, beta, step))


def _objective(name: str) -> Objective:
    try:
        return get(name)
    except ValueError as err:
        raise ContractError(str(err)) from None


def _check_request(objective: Objective, splits: Splits, convention: Convention, count_masked: str | None,
                   beta: float, step: bool) -> None:
    """Refuse, in one line, what the objective or the step form cannot be audited under."""
    if count_masked is not None and objective.name != "grpo":
        raise ContractError("masked tokens (count_masked) are GRPO's truncated responses and rejected tokens; "
                            f"an {objective.name.upper()} audit takes none")
    if objective.name == "dpo" and (splits.pack or splits.context_parallel > 1 or splits.pipeline_microbatches):
        raise ContractError("a DPO audit splits by pairs: W, A, shardings and token budgets; packing, context "
                            "parallelism and pipelines are not simulated for pairs")
    if step and (splits.context_parallel > 1 or splits.pipeline_microbatches):
        raise ContractError("a step is audited over data-parallel ranks and their microbatches; context "
                            "parallelism and pipelines need a microbatch loss")
    if step and convention.scale_by_accum:
        raise ContractError("a step applies its own scaling: scale_by_accum (--scale-by-accum) is for a "
                            "microbatch loss")
    if not (math.isfinite(beta) and beta > 0):
        raise ContractError(f"beta must be a positive finite number, got {beta!r}")
