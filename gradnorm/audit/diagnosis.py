"""The audit's decision as data: what a ``Report`` finds, computed once, before any word is written.

``diagnose(report)`` is a small frozen tree, and ``gradnorm.audit.verdict`` turns it into English:

    Diagnosis   headline      WRONG SIGN, SCALED, MISCOUNTS, SKEWED, LEAKS or INVARIANT
                skews         one ``Skew`` per axis the loss is skewed by alone
                match         ``Match``: the mode the weights equal, and how (exactly, up to a
                              factor, by rounding, by a tie, by each rank's own count, not at all)
                loud          a skewed term's total weight against one process, where furthest from 1
                failing       a composite loss: its failing terms, first the one the verdict leads with

A ``Skew`` says how much one axis changes the weights, on which configurations, the mode matched
without it, and its cause, by one of two tests:

    a uniform factor   every token weighs c times the mode's weight; c = K (or 1/K) names a
                       context-parallel reduction, c = 1/P (or P) a pipeline schedule's combining,
                       and c_r = k / A_r on each rank r a division by the rank's own microbatch count
    uniform units      every counted token of a unit (a packed row, a rank's chunk, a pipeline
                       microbatch) weighs the same while the mode's weights differ there: the
                       loss takes a mean over the unit, as if it were one sequence or one batch

The ``counts`` axis is the microbatches' numbers of sequences (or pairs): a loss invariant on every
plan whose microbatches hold equal numbers and skewed on another.

Adding an axis or a cause is adding a row here and a sentence in the words' table; no precedence
chain is shared between the decision and its English.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradnorm.audit.decide import Near, Report
from gradnorm.audit.measurement import Result

AXES = ("budget", "pack", "cp", "pipeline")
"""The axes of ``gradnorm.audit.splits`` a loss can be skewed by alone, in the order the verdict says them."""


@dataclass(frozen=True)
class Skew:
    """Skewed by one axis alone: every configuration without it invariant, one with it not."""

    axis: str  # "budget", "pack", "cp", "pipeline", or "counts" (unequal numbers of sequences or pairs)
    change: float  # the largest relative change of a token's weight under the axis
    where: tuple[str, ...]  # the labels of the configurations it changes (counts: those that changed)
    mode: str | None  # the mode matched without the axis (None: none is)
    cause: str | None  # "accum_r", "unit_mean", "sum_over_k", "times_k", "over_k", "over_p", "times_p"
    size: int = 0  # K, P; budget: the fewest microbatches a rank holds
    most: int = 0  # budget: the most microbatches a rank holds
    even: tuple[str, ...] = ()  # counts: the shardings whose microbatches hold equal counts (the advice)
    budget: bool = False  # counts: a token budget is among the configurations (drop it to narrow)


@dataclass(frozen=True)
class Match:
    """What the weights equal, and how."""

    how: str  # "mode", "constant", "scaled", "tie", "rounded", "near", "per_rank", "none", "unsaid"
    mode: str | None = None  # the mode (near: Near.mode; rounded: the mode rounded)
    near: Near | None = None  # how: "near"
    dtype: str | None = None  # how: "rounded"
    tied: tuple[str, ...] = ()  # how: "tie", every mode matched


@dataclass(frozen=True)
class Diagnosis:
    """The verdict as data (see the module docstring)."""

    headline: str  # "WRONG SIGN", "SCALED", "MISCOUNTS", "SKEWED", "LEAKS", "INVARIANT"
    skews: tuple[Skew, ...]
    match: Match
    loud: tuple[float, Result] | None = None  # a skewed term's (how many times one process', where)
    failing: tuple[str, ...] = ()  # a composite loss's failing terms


def diagnose(report: Report) -> Diagnosis:
    """The decision about ``report``: pure, from its numbers, in the order the verdict says it."""
    failing = tuple(name for name, term in report.terms.items() if term.exit_code)
    skews = tuple(s for axis in AXES if (s := _axis_skew(report, axis)))
    if report.skewed_only_by_unequal_counts and not any(s.axis == "budget" for s in skews):
        skews += (_counts_skew(report),)
    if report.scaled and not report.leaks and not report.wrong_sign:
        headline = "SCALED"
    elif report.wrong_sign:
        headline = "WRONG SIGN"
    elif report.invariant and not report.leaks and report.masked and report.masked.counts_dropped:
        headline = "MISCOUNTS"  # the weights are otherwise the same in every configuration
    else:
        headline = "SKEWED" if not report.invariant else "LEAKS" if report.leaks else "INVARIANT"
    loud = report.loudness if report.term and not report.invariant else None
    if loud is not None and close(loud[0], 1.0, report.tol):
        loud = None
    axis_said = any(s.axis != "counts" for s in skews)
    return Diagnosis(headline, skews, _match(report, axis_said, any(s.axis == "counts" for s in skews)), loud,
                     failing)


def _match(report: Report, axis_said: bool, counts_said: bool) -> Match:
    """What the weights equal; an axis's clause names the mode better than a factor, so a factor is unsaid then."""
    if report.rounded:
        mode, dtype = report.rounded
        return Match("rounded", mode, dtype=dtype)
    if report.equals == "local" and len(report.matches) > 1:  # the bug's mode, only because nothing tells them apart
        return Match("tie", "local", tied=tuple(report.matches))
    if report.equals == "constant":
        return Match("scaled" if report.scaled else "constant", "constant")
    if report.equals:
        return Match("mode", report.equals)
    if report.near and not axis_said:
        return Match("near", report.near.mode, near=report.near)
    if report.per_rank_count and not axis_said:
        return Match("per_rank", report.per_rank_count.mode)
    if not counts_said and not axis_said:
        return Match("none")
    return Match("unsaid")  # the clauses above name the mode


# ---- the axes

def close(a: float, b: float, tol: float) -> bool:
    """a and b agree to the relative tolerance tol."""
    return abs(a - b) <= tol * max(abs(a), abs(b))


def skewed_only_by(report: Report, axis: str) -> bool:
    """Invariant on every configuration without ``axis``, skewed on one with it."""
    within = [r.change for r in report.results[1:] if axis in r.axes]
    without = [r.change for r in report.results[1:] if axis not in r.axes]
    return bool(within) and max(within) > report.tol and all(c <= report.tol for c in without)


def _mode_without(report: Report, axis: str) -> str | None:
    """The first mode matched by the reference and every configuration without ``axis``."""
    without = [r for r in report.results if axis not in r.axes]
    return next((m for m in report.modes if max(r.distance[m] for r in without) <= report.tol), None)


def _units(result: Result, axis: str) -> list:
    """Flat positions of each unit: a packed row (pack), or a call's positions (cp, pipeline)."""
    S, T = result.weights.shape
    if axis == "pack":
        rows = [row for call in result.layout.calls for row in call.index]
    else:
        rows = [call.index.reshape(-1) for call in result.layout.calls]
    return [row[row < S * T] for row in rows]


def _uniform_units(report: Report, axis: str) -> bool:
    """Every unit's counted tokens weigh the same, on every result with ``axis``, where the reference's differ."""
    tol, mask = report.tol, report.batch.mask.reshape(-1)
    reference = report.results[0].weights.reshape(-1)
    informative = False
    for result in (r for r in report.results if axis in r.axes):
        w = result.weights.reshape(-1)
        for unit in _units(result, axis):
            unit = unit[mask[unit]]
            if len(unit) < 2:
                continue
            if not close(float(w[unit].max()), float(w[unit].min()), tol):
                return False
            informative |= not close(float(reference[unit].max()), float(reference[unit].min()), tol)
    return informative


def _common_factor(report: Report, axis: str, mode: str) -> float | None:
    """c when every result with ``axis`` weighs every token c times ``mode``'s weight, else None."""
    factors = [r.factor.get(mode) for r in report.results if axis in r.axes]
    if not factors or None in factors or not all(close(c, factors[0], report.tol) for c in factors):
        return None
    return factors[0]


def _per_rank_accum(report: Report) -> bool:
    """On every token-budget result, rank r's tokens weigh k / A_r times their weight in one process (one k)."""
    mask, expected = report.batch.mask, report.results[0].weights
    for result in (r for r in report.results if "budget" in r.axes):
        ks = []
        for rank in result.plan:
            for mb in rank:
                kept = mask[mb]
                got, want = result.weights[mb][kept], expected[mb][kept]
                if len(got) == 0:
                    continue
                ratio = got / want
                if not close(float(ratio.max()), float(ratio.min()), report.tol):
                    return False
                ks.append(float(ratio.mean()) * len(rank))
        if not ks or not all(close(k, ks[0], report.tol) for k in ks):
            return False
    return True


def _budget_skew(report: Report) -> Skew | None:
    """Under a token budget, each rank's tokens k / A_r times their one-process weight: a division by A_r."""
    within = [r for r in report.results if "budget" in r.axes]
    if not within or max(r.change for r in within) <= report.tol or not _per_rank_accum(report):
        return None
    counts = [n for r in within for n in r.layout.microbatch_counts]
    return Skew("budget", max(r.change for r in within), tuple(r.label for r in within if r.change > report.tol),
                None, "accum_r", min(counts), max(counts))


def _axis_skew(report: Report, axis: str) -> Skew | None:
    """The skew of one axis of ``AXES``, with its cause when a test finds one."""
    if axis == "budget":
        return _budget_skew(report)
    if not skewed_only_by(report, axis):
        return None
    mode = _mode_without(report, axis)
    within = [r for r in report.results if axis in r.axes]
    layout = within[0].layout
    K, P = layout.context_parallel, layout.pipeline_microbatches
    c = _common_factor(report, axis, mode) if mode else None
    tol, cause, size = report.tol, None, {"cp": K, "pipeline": P}.get(axis, 0)
    if axis == "pack":
        cause = "unit_mean" if _uniform_units(report, axis) else None
    elif axis == "cp":
        if c is not None and close(c, K, tol):
            cause = "sum_over_k" if report.convention.cp_reduction == "mean" else "times_k"
        elif c is not None and close(c, 1 / K, tol):
            cause = "over_k"
        elif _uniform_units(report, axis):
            cause = "unit_mean"
    else:
        if c is not None and close(c, 1 / P, tol):
            cause = "over_p"
        elif c is not None and close(c, P, tol):
            cause = "times_p"
        elif _uniform_units(report, axis):
            cause = "unit_mean"
    return Skew(axis, max(r.change for r in within), tuple(r.label for r in within if r.change > tol), mode,
                cause, size)


def _counts_skew(report: Report) -> Skew:
    """Invariant on fixed-size microbatches, skewed only where sequence (pair) counts differ, and only where they changed."""
    even = tuple(dict.fromkeys(r.label for r in report.results[1:] if r.equal_counts and not r.axes))
    uneven = [r for r in report.results[1:] if not r.equal_counts and r.change > report.tol]
    return Skew("counts", max(r.change for r in uneven), tuple(dict.fromkeys(r.label for r in uneven)),
                report.equals_at_equal_counts, None, even=even,
                budget=any("budget" in r.axes for r in report.results))
