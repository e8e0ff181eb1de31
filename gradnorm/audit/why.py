"""Why a loss is skewed by one split: the clauses the verdict adds for each axis of ``splits``.

A loss is "skewed only by" an axis when every configuration without it is invariant and one with
it is not. The clause then says what the weights show under that axis, by one of two tests:

    a uniform factor   every token weighs c times the mode's weight; c = K (or 1/K) names a
                       context-parallel reduction, c = 1/P a pipeline schedule's mean, and
                       c_r = k / A_r on each rank r a division by the rank's own microbatch count
    uniform units      every counted token of a unit (a packed row, a rank's chunk, a pipeline
                       microbatch) weighs the same while the mode's weights differ there: the
                       loss takes a mean over the unit, as if it were one sequence or one batch
"""

from __future__ import annotations

from torch import Tensor

from gradnorm.audit.masking import MaskedFinding
from gradnorm.audit.probe import MODES, Report, Result

BUDGET_LEAD = "under a token budget"


def _close(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol * max(abs(a), abs(b))


def skewed_only_by(report: Report, axis: str) -> bool:
    """Invariant on every configuration without ``axis``, skewed on one with it."""
    within = [r.change for r in report.results[1:] if axis in r.axes]
    without = [r.change for r in report.results[1:] if axis not in r.axes]
    return bool(within) and max(within) > report.tol and all(c <= report.tol for c in without)


def _mode_without(report: Report, axis: str) -> str | None:
    """The first mode matched by the reference and every configuration without ``axis``."""
    without = [r for r in report.results if axis not in r.axes]
    return next((m for m in MODES if max(r.distance[m] for r in without) <= report.tol), None)


def _units(result: Result, axis: str) -> list[Tensor]:
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
            if not _close(float(w[unit].max()), float(w[unit].min()), tol):
                return False
            informative |= not _close(float(reference[unit].max()), float(reference[unit].min()), tol)
    return informative


def _common_factor(report: Report, axis: str, mode: str) -> float | None:
    """c when every result with ``axis`` weighs every token c times ``mode``'s weight, else None."""
    factors = [r.factor.get(mode) for r in report.results if axis in r.axes]
    if not factors or None in factors or not all(_close(c, factors[0], report.tol) for c in factors):
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
                if not _close(float(ratio.max()), float(ratio.min()), report.tol):
                    return False
                ks.append(float(ratio.mean()) * len(rank))
        if not ks or not all(_close(k, ks[0], report.tol) for k in ks):
            return False
    return True


def _budget_clause(report: Report) -> str | None:
    """Under a token budget, each rank's tokens k / A_r times their one-process weight: a division by A_r."""
    within = [r for r in report.results if "budget" in r.axes]
    if not within or max(r.change for r in within) <= report.tol or not _per_rank_accum(report):
        return None
    counts = [n for r in within for n in r.layout.microbatch_counts]
    return (f"{BUDGET_LEAD} (ranks hold {min(counts)} to {max(counts)} microbatches) every token of rank r weighs "
            f"1/A_r times its weight in one process, skewed by up to {max(r.change for r in within):.1%}: your loss "
            f"or loop divides by this rank's number of microbatches A_r, which a token budget makes differ by rank; "
            f"divide by the global counts alone")


def _clause(report: Report, axis: str) -> str | None:
    if axis == "budget":
        return _budget_clause(report)
    if not skewed_only_by(report, axis):
        return None
    mode = _mode_without(report, axis)
    within = [r for r in report.results if axis in r.axes]
    worst = max(r.change for r in within)
    like = (f"a constant denominator C = {report.constant:.6g}" if mode == "constant" else f"gradnorm's `{mode}`")
    where = f", where it equals {like}" if mode else ""
    layout = within[0].layout
    K, P, conv = layout.context_parallel, layout.pipeline_microbatches, report.convention
    reason = None
    c = _common_factor(report, axis, mode) if mode else None
    if axis == "pack":
        lead, skew = "invariant on unpacked rows", "on rows packed back to back"
        if _uniform_units(report, axis):
            reason = ("every token of a packed row gets the same weight: your loss averages each row as if it were "
                      "one sequence (a per-row mean over packs); divide each token by its own sequence's length "
                      "(ask for sequence_ids and sequence_tokens)")
    elif axis == "cp":
        lead, skew = "invariant without context parallelism", f"when each row is split over {K} ranks"
        if c is not None and _close(c, K, report.tol):
            reason = (f"every weight is K = {K} times too large: are gradients summed over each context-parallel "
                      "group? then audit with --cp-reduction sum" if conv.cp_reduction == "mean" else
                      f"every weight is K = {K} times too large: your loss multiplies by K, which a sum over the "
                      "group does not need")
        elif c is not None and _close(c, 1 / K, report.tol):
            reason = (f"every weight is divided by K = {K}: the mean over dp x cp ranks divides by W*K, and your "
                      "loss undoes only W; multiply by context_parallel")
        elif _uniform_units(report, axis):
            reason = ("every token of a rank's chunk gets the same weight, set by the chunk's own token count (a "
                      "per-chunk mean); divide the chunk's token sum by the global count num_tokens")
    else:
        lead = "invariant without a pipeline"
        skew = f"under a pipeline schedule of {P} microbatches combined by {conv.pipeline_combine}"
        if c is not None and _close(c, 1 / P, report.tol):
            reason = (f"the schedule's mean divides every weight by P = {P}: multiply by pipeline_microbatches, or "
                      "audit with --pipeline-combine sum if your schedule sums")
        elif c is not None and _close(c, P, report.tol):
            reason = (f"every weight is P = {P} times too large: does your schedule average its microbatches' "
                      "losses? then audit with --pipeline-combine mean")
        elif _uniform_units(report, axis):
            reason = ("every token of a pipeline microbatch gets the same weight, set by its own token count (a "
                      "per-microbatch mean); divide by the global count num_tokens instead")
    text = f"{lead}{where}; skewed by up to {worst:.1%} {skew}"
    return f"{text}: {reason}" if reason else text


def axis_clauses(report: Report) -> list[str]:
    """One clause for each axis the loss is skewed by alone (none when it is skewed without any)."""
    return [c for axis in ("budget", "pack", "cp", "pipeline") if (c := _clause(report, axis))]


def masked_clause(m: MaskedFinding) -> str:
    """Whether the denominator counts the tokens declared dropped, and what that does to every kept token."""
    if m.dropped_tokens == 0:
        return "no generated token is declared dropped: the loss should count them all"
    if m.counts_dropped is None:
        return (f"the audit cannot tell whether the denominator counts the {m.dropped_tokens} tokens declared "
                f"dropped: the kept tokens' weights fit no mode with either count")
    if not m.counts_dropped:
        return (f"the denominator leaves out the {m.dropped_tokens} tokens declared dropped "
                f"(`{m.mode}` counted over the {m.kept_tokens} kept tokens)")
    low, high = m.ratio
    change = (f"{low:.4g} times what it should ({low - 1:+.1%})" if abs(high - low) <= 1e-9 * high else
              f"{low:.4g} to {high:.4g} times what it should ({low - 1:+.1%} to {high - 1:+.1%})")
    return (f"the denominator COUNTS the {m.dropped_tokens} tokens declared dropped (`{m.mode}` counted over all "
            f"{m.response_tokens} generated tokens): every kept token weighs {change}")
