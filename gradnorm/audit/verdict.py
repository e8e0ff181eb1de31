"""The verdict in words: every sentence the audit prints about a ``Report``, in one place.

The decision is data, made before any word (``gradnorm.audit.diagnosis.diagnose``: the headline,
one ``Skew`` per axis, the ``Match``); this module only says it. ``verdict`` is the one line the
command ends with, ``words`` the same from a given ``Diagnosis``; each headline, each way of
matching a mode and each axis's cause has its sentence in a table (``HEADLINES``, ``MATCHES``,
``AXIS_WORDS``, ``CAUSES``), so a new axis or cause is a row here and a row there.
``explain_factor`` names a uniform factor in W and A and what it says about the loss.
``format_report`` is the command's whole output, ``verdict_table`` one row per audited loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch

from gradnorm.audit.decide import Near, Report
from gradnorm.audit.diagnosis import Diagnosis, Match, Skew, close, diagnose
from gradnorm.audit.masking import MaskedFinding
from gradnorm.audit.measurement import Convention
from gradnorm.audit.objectives import GRPO

WRONG_SIGN = GRPO.wrong_sign  # GRPO's; each objective says its own (``Objective.wrong_sign``)


def _symbol(letter: str, power: int) -> str:
    return letter if abs(power) == 1 else f"{letter}^{abs(power)}"


def _law(p: int, q: int) -> str:
    """W^p * A^q written out: W, 1/A, W*A, 1/(W*A), W/A^2, 1."""
    up = "*".join(_symbol(x, e) for x, e in (("W", p), ("A", q)) if e > 0)
    down = "*".join(_symbol(x, e) for x, e in (("W", p), ("A", q)) if e < 0)
    if not down:
        return up or "1"
    return f"{up or 1}/{f'({down})' if '*' in down else down}"


def factor_name(near: Near, tol: float) -> str:
    """k * W^p * A^q in words: ``1/W``, ``1/W or 1/A`` (W = A), ``-1``, ``3``, ``0.5 x W``."""
    if not near.powers:
        return f"that changes with W and A in no simple way (from {min(near.factors):.4g} to {max(near.factors):.4g})"
    laws = [_law(p, q) for p, q in near.powers]
    if abs(near.scale - 1) <= tol:
        return " or ".join(laws)
    if abs(near.scale + 1) <= tol:
        return " or ".join("-1" if law == "1" else f"-{law}" for law in laws)
    return " or ".join(f"{near.scale:.4g}" if law == "1" else f"{near.scale:.4g} x {law}" for law in laws)


def _why(p: int, q: int, convention: Convention) -> list[str]:
    """What a factor W^p * A^q says about the loss (and the loop the audit assumed)."""
    says = []
    if p < 0:
        says.append(("is missing the world-size factor W" if p == -1 else f"is missing a factor W^{-p}")
                    + " (DDP's mean over ranks divides every weight by W)")
    if p > 0:
        says.append(("has a factor W too many" if p == 1 else f"has a factor W^{p} too many")
                    + (" (are gradients summed over ranks? then audit with --reduction sum)"
                       if convention.reduction == "mean" and not convention.measured else ""))
    if q < 0:
        says.append(("divides by A once too often" if q == -1 else "divides by A twice too often")
                    + (" (counting the loop's division by A)" if convention.scale_by_accum else ""))
    if q > 0:
        says.append(("is missing a division by A" if q == 1 else "is missing two divisions by A")
                    + ("" if convention.scale_by_accum or convention.measured
                       else " (if your loop divides by A, audit with --scale-by-accum)"))
    return says


def explain_factor(near: Near, convention: Convention, tol: float, subject: str = "your loss") -> str:
    """``up to a factor 1/W: your loss is missing the world-size factor W (...)``: the factor, then why."""
    readings = [" and ".join(_why(p, q, convention)) for p, q in near.powers]  # one per law that fits
    constant = near.powers and abs(abs(near.scale) - 1) > tol  # a constant k besides W^p * A^q
    text = f"up to a factor {factor_name(near, tol)}"
    if constant and any(readings):  # one factor, k x W^p A^q: say which part is which, not two factors
        text += (f", the constant {abs(near.scale):.4g} (the same under every W and A: a coefficient?) times "
                 f"{' or '.join(_law(p, q) for p, q in near.powers)}")
    elif constant:
        readings = [f"weighs every token {abs(near.scale):.4g} times what `{near.mode}` gives"]
    readings = [r for r in readings if r]  # k = -1 alone: the wrong sign, which the verdict says first
    if readings:
        text += f": {subject} " + " or ".join(readings)
    if len(near.powers) > 1:
        text += " (audit with W != A to tell which)"
    return text


def percent(x: float, rounding: float = 0.0) -> str:
    """A share as a percentage that never reads 0.0% when it is more than ``rounding`` (the audit's
    tolerance: float rounding, not a signal, reads 0.0%): 0.3%, 0.0031%, 3e-06%."""
    if abs(x) <= rounding or abs(x) >= 0.001:
        return f"{x:.1%}"
    return f"{100 * x:.2g}%"


def loudness_clause(report: Report) -> str | None:
    """``32x too loud at W=1 A=32 (interleave)``: the total weight against one process', where furthest from 1."""
    ratio, where = report.loudness
    if close(ratio, 1.0, report.tol):
        return None
    how = f"{ratio:.3g}x too loud" if ratio > 1 else f"{1 / ratio:.3g}x too quiet" if ratio > 0 else f"{ratio:.3g}x"
    return f"{how} at W={where.world_size} A={where.accum_label} ({where.label}) against one process"


def change_clause(report: Report) -> str:
    """The largest change, said as a change of what: a token's weight (a pair's, for DPO) against one process."""
    whose = "a pair's weight on its tokens" if report.objective.unit == "pair" else "a token's weight"
    return (f"{whose} changes by up to {percent(report.change, report.tol)} of its weight in one process across "
            "configurations")


def scaled_clause(report: Report) -> str:
    """An invariant loss a whole number of times too loud: the scale, then what the fitted C would have hidden."""
    k = report.scaled.times
    return (f"every gradient {k} times too large: every token weighs {k} times what gradnorm's `token` gives, under "
            f"every configuration and in one process (backward {k} times per microbatch, or the loss counted {k} "
            f"times?); read as a constant denominator it would be C = N / {k} = {report.scaled.constant:.6g}")


UNITS = {"token": ("tokens", "N"), "sequence": ("sequences", "S"), "pair": ("pairs", "P")}
"""Each mode's unit and its symbol, for the per-rank count's clause."""


def per_rank_clause(report: Report) -> str:
    """Each rank divides by its own count: the law, the trainers known to do it, the fix."""
    found, W = report.per_rank_count, [r.world_size for r in report.results]
    units, n = UNITS[found.mode]
    if all(close(k * w, 1, report.tol) for k, w in zip(found.per_rank, W)):
        law = f"{n} / (W * {n}_r)"
    elif all(close(k, 1, report.tol) for k in found.per_rank):
        law = f"{n} / {n}_r"
    else:
        law = f"a multiple of {n} / {n}_r"
    return (f"each rank divides by its own count: rank r's tokens weigh {law} times what gradnorm's `{found.mode}` "
            f"gives, {n}_r the {units} rank r holds (a rank-local mean, as transformers' Trainer with "
            f"average_tokens_across_devices off, or a rank's own token share); divide by the global count "
            f"{n}, all-reduced over the ranks")


def term_lines(report: Report) -> list[str]:
    """One line per named term of a composite loss: its own verdict."""
    return [f"term {name!r}: {verdict(term)}" for name, term in report.terms.items()]


def verdict(report: Report) -> str:
    """One line: the headline (wrong sign, scaled, miscounts, skewed, leaking or invariant), then each finding.

    The decision is ``gradnorm.audit.diagnosis.diagnose``'s; this says it. A composite loss's line
    leads with its failing terms (``term_lines`` has every term's own).
    """
    return words(report, diagnose(report))


def words(report: Report, found: Diagnosis) -> str:
    """``found`` in English, in the order it is decided: headline, loudness, axes, leak, masking, match."""
    if found.failing:
        worst = report.terms[found.failing[0]]
        others = f" (and {', '.join(map(repr, found.failing[1:]))})" if found.failing[1:] else ""
        whole = verdict(replace(report, terms={}))
        return (f"SKEWED in term {found.failing[0]!r}{others}: {loudness_clause(worst) or verdict(worst)}; "
                f"the loss's total reads {whole}")
    change = change_clause(report)
    parts = HEADLINES[found.headline](report, change)
    if found.loud is not None:
        parts.append(loudness_clause(report))
    parts += [skew_clause(report, skew) for skew in found.skews]
    if report.leaks:
        dropped = " or declared dropped (truncated responses, rejected tokens)" if report.masked else ""
        parts.append(f"{report.leak:.1%} of the weight LEAKS onto tokens outside the mask{dropped}")
    if report.masked and found.headline != "MISCOUNTS":
        parts.append(masked_clause(report.masked))
    said = MATCHES[found.match.how](report, found.match)
    return "; ".join(parts + ([said] if said else []))


HEADLINES = {
    "WRONG SIGN": lambda r, change: [f"WRONG SIGN: {r.objective.wrong_sign} ({r.negative:.1%} of the weight inside "
                                     "the mask is negative)", change],
    "SCALED": lambda r, change: [f"SCALED: {scaled_clause(r)}", f"otherwise invariant ({change})"],
    "MISCOUNTS": lambda r, change: [f"MISCOUNTS: {masked_clause(r.masked)}", f"otherwise invariant ({change})"],
    "SKEWED": lambda r, change: [f"SKEWED: {change}"],
    "LEAKS": lambda r, change: [f"LEAKS: {change}"],
    "INVARIANT": lambda r, change: [f"INVARIANT: {change}"],
}
"""The verdict's first words, by the diagnosis' headline."""


def _like(report: Report, mode: str) -> str:
    return f"a constant denominator C = {report.constant:.6g}" if mode == "constant" else f"gradnorm's `{mode}`"


def _rounded(report: Report, match: Match) -> str:
    what = f"equals a constant denominator C = {report.constant:.6g}, which is" if report.equals else "equals"
    return (f"{what} gradnorm's `{match.mode}` to within the rounding of {match.dtype} "
            f"({percent(report.distance[match.mode])} off): the loss computes its weights in {match.dtype}; audit it "
            "in float32 to tell them apart")


def _tie(report: Report, match: Match) -> str:
    named = [f"a constant C = {report.constant:.6g}" if m == "constant" else f"`{m}`" for m in match.tied]
    return (f"equals gradnorm's {', '.join(named[:-1])} and {named[-1]} alike: on this synthetic minibatch "
            f"({_sameness(report)}) they give every token the same weight, so the audit cannot tell them apart; "
            "audit with a minibatch whose lengths vary (--max-new-tokens above 1)")


def _near(report: Report, match: Match) -> str:
    near, hint = match.near, ""
    if report.objective.name == "dpo" and near.powers == ((0, 0),) and not report.term:
        hint = f" ({pair_factor_reading(near.scale, report.point.beta)})"
    subject = "the term" if report.term else "the trainer" if report.convention.measured else "your loss"
    return f"equals {_like(report, near.mode)} {explain_factor(near, report.convention, report.tol, subject)}{hint}"


MATCHES = {
    "rounded": _rounded,
    "tie": _tie,
    "constant": lambda r, m: f"equals a constant denominator C = {r.constant:.6g}",
    "scaled": lambda r, m: None,  # the headline says it
    "mode": lambda r, m: f"equals gradnorm's `{m.mode}`",
    "near": _near,
    "per_rank": lambda r, m: per_rank_clause(r),
    "none": lambda r, m: "equals no gradnorm mode",
    "unsaid": lambda r, m: None,  # an axis's clause names the mode
}
"""The verdict's last clause, by how the weights match a mode."""


def pair_factor_reading(k: float, beta: float) -> str:
    """What a factor k on every pair's weight says: the audit reads at slope beta/2 (margin 0); a loss
    with its own beta_s reads k = beta_s / beta, one with a target margin gamma, -log sigmoid(beta_s m -
    gamma) (SimPO), reads k = (beta_s / beta) * 2 sigmoid(gamma), which alone lies in (1, 2)."""
    beta_reading = f"a beta of {k * beta:.4g}, where the audit reads with beta = {beta:g}: --beta sets it"
    if 1 < k < 2:
        gamma = math.log(k / (2 - k))  # 2 sigmoid(gamma) = k
        return (f"a target margin gamma = {gamma:.4g}: SimPO's -log sigmoid(beta m - gamma) reads 2 sigmoid(gamma) "
                f"= {k:.4g} times at the audit's point; or {beta_reading}")
    return (f"{beta_reading}; a target margin gamma adds a factor 2 sigmoid(gamma) besides (SimPO): with --beta "
            "set to your loss's, what is left is that margin's")


def _sameness(report: Report) -> str:
    """What makes the modes tie on this minibatch, as far as its lengths say."""
    lengths = report.batch.response.sum(-1)
    if int(lengths.min()) == int(lengths.max()):
        return f"every response {int(lengths.min())} token{'s' if int(lengths.min()) != 1 else ''} long"
    return f"responses of {int(lengths.min())} to {int(lengths.max())} tokens, split alike"


def _minibatch_line(report: Report) -> str:
    """What the synthetic minibatch holds, in the objective's units, and the loop around the loss."""
    conv, point = report.convention, report.point
    if conv.measured:
        return f"minibatch: {_held(report)}; the trainer's own loop, run on real ranks and read where its optimizer steps"
    if point.step:
        loop = "backward by your step, scaled as it scales"
    else:
        loop = "backward of loss / A" if conv.scale_by_accum else "backward of loss as returned"
    axes = set().union(*(r.axes for r in report.results))
    if "cp" in axes:
        loop += f", context-parallel gradients {conv.cp_reduction}-reduced over each group"
    if "pipeline" in axes:
        loop += f", pipeline losses combined by {conv.pipeline_combine}"
    return f"minibatch: {_held(report)}; {loop}, gradients {conv.reduction}-reduced over ranks"


def _held(report: Report) -> str:
    """What the minibatch holds, in the objective's units."""
    b, point = report.batch, report.point
    lengths = b.response.sum(-1)
    span = f"{int(lengths.min())} to {int(lengths.max())} tokens (N = {int(b.mask.sum())})"
    if report.objective.name == "dpo":
        held = (f"{len(lengths) // 2} preference pairs, chosen and rejected responses of {span}, read at "
                f"pi = pi_ref with beta = {point.beta:g}")
    elif report.objective.name == "sft":
        held = f"{len(lengths)} sequences of {span.replace('tokens', 'label tokens', 1)}"
    else:
        held = f"{len(lengths)} responses in {b.num_groups} groups of {b.group_size}, {span}"
    return held


def format_report(report: Report) -> str:
    """The command's output: the minibatch, a row per configuration, distances, each term, the verdict."""
    b = report.batch
    lines = [f"audit of {report.name} ({report.objective.name.upper()})", _minibatch_line(report)]
    if report.masked:
        m = report.masked
        lines.append(f"masked tokens: {m.response_tokens} generated, {m.dropped_tokens} of them declared dropped "
                     f"({m.truncated_tokens} in truncated responses, {m.rejected_tokens} rejected); "
                     f"the loss should count {b.count_masked}")
    lines.append(f"{'W':>3} {'A':>3}  {'sharding':<22} {'max change':>10}  loudest rank: update share / token share")
    for r in report.results:
        ratio = torch.where(r.token_share > 0, r.update_share / r.token_share.clamp(min=1e-300), -math.inf)
        k = int(torch.argmax(ratio))
        lines.append(f"{r.world_size:>3} {r.accum_label:>3}  {r.label:<22} {r.change:>10.1%}  "
                     f"rank {k}: {r.update_share[k]:.1%} / {r.token_share[k]:.1%}")
    dist = " | ".join(f"{m} {report.distance[m]:.2g}" for m in report.modes)
    constant = f" (C = N / sum w = {report.constant:.6g}, fitted to the reference)" if "constant" in report.modes else ""
    lines.append(f"distance to each mode (max |w - w_mode| / max |w_mode|, worst configuration): {dist}{constant}")
    lines.append(f"weight outside the mask: {report.leak:.1%} of the total")
    if (said := tolerance_line(report)) is not None:
        lines.append(said)
    if report.residual > report.tol and not report.terms:
        lines.append(f"note: part of the gradient does not scale with the advantages ({report.residual:.2g} of the "
                     f"surrogate's; a k1 KL, an entropy bonus?); the weights above exclude it (name the loss's "
                     f"terms to audit each)")
    lines += term_lines(report)
    lines.append(f"verdict: {verdict(report)}")
    return "\n".join(lines)


FLOAT_MARGIN = 16
"""Unit roundoffs a float32 loss may read from its mode: a weight passes through a few roundings (the
advantage's cast, a division by a count, the scaling), a few unit roundoffs in all; the catalogue's
losses, cast to float32, stay within a quarter of this at W 16 x A 8 (tests/unit/audit). A ``--tol``
below it is flagged; the default 1e-6 is 16.8."""


def tolerance_line(report: Report) -> str | None:
    """What the comparisons' tolerance is in the unit roundoffs of the dtype the loss returned (float32 or
    coarser; a float64 loss says nothing), and whether it leaves the loss's own rounding room."""
    dtypes = [r.dtype for r in report.results if r.dtype is not None]
    if not dtypes:
        return None
    dtype = max(dtypes, key=lambda d: torch.finfo(d).eps)
    unit = torch.finfo(dtype).eps / 2
    if dtype == torch.float64:
        return None
    name = str(dtype).removeprefix("torch.")
    text = (f"tolerance: {report.tol:.2g} relative, {report.tol / unit:.3g} unit roundoffs of {name} "
            f"({unit:.3g}), the dtype your loss returns")
    if dtype == torch.float32 and report.tol < FLOAT_MARGIN * unit:  # 16-bit rounding: ``Report.rounded``
        text += (f"; below the {FLOAT_MARGIN} a {name} loss's own rounding may read: raise --tol to "
                 f"{FLOAT_MARGIN * unit:.2g} or compute the loss in float64")
    return text


def verdict_table(reports: Sequence[Report]) -> str:
    """One row per audited loss: invariant?, the largest change, leak, the mode it equals."""
    rows = [f"{'loss':<36} {'verdict':<10} {'max change':>10} {'leak':>6}  equals"]
    for r in reports:
        equals = f"constant C = {r.constant:.6g}" if r.equals == "constant" else (r.equals or "-")
        skewed = not r.invariant or any(t.exit_code for t in r.terms.values())
        how = ("WRONG SIGN" if r.wrong_sign else "SKEWED" if skewed else "LEAKS" if r.leaks else
               "SCALED" if r.scaled else "invariant")
        rows.append(f"{r.name:<36} {how:<10} {r.change:>10.1%} "
                    f"{r.leak:>6.1%}  {equals}")
    return "\n".join(rows)


# ---- why a loss is skewed by one split: the words of each Skew

BUDGET_LEAD = "under a token budget"

AXIS_WORDS = {  # axis: (what it is invariant without, where it is skewed)
    "pack": lambda s, conv: ("invariant on unpacked rows", "on rows packed back to back"),
    "cp": lambda s, conv: ("invariant without context parallelism", f"when each row is split over {s.size} ranks"),
    "pipeline": lambda s, conv: ("invariant without a pipeline", f"under a pipeline schedule of {s.size} microbatches "
                                                                 f"combined by {conv.pipeline_combine}"),
}

CAUSES = {  # (axis, cause): why, in words
    ("pack", "unit_mean"): lambda s: "every token of a packed row gets the same weight: your loss averages each row "
                                     "as if it were one sequence (a per-row mean over packs); divide each token by "
                                     "its own sequence's length (ask for sequence_ids and sequence_tokens)",
    ("cp", "sum_over_k"): lambda s: f"every weight is K = {s.size} times too large: are gradients summed over each "
                                    "context-parallel group? then audit with --cp-reduction sum",
    ("cp", "times_k"): lambda s: f"every weight is K = {s.size} times too large: your loss multiplies by K, which a "
                                 "sum over the group does not need",
    ("cp", "over_k"): lambda s: f"every weight is divided by K = {s.size}: the mean over dp x cp ranks divides by "
                                "W*K, and your loss undoes only W; multiply by context_parallel",
    ("cp", "unit_mean"): lambda s: "every token of a rank's chunk gets the same weight, set by the chunk's own token "
                                   "count (a per-chunk mean); divide the chunk's token sum by the global count "
                                   "num_tokens",
    ("pipeline", "over_p"): lambda s: f"the schedule's mean divides every weight by P = {s.size}: multiply by "
                                      "pipeline_microbatches, or audit with --pipeline-combine sum if your schedule sums",
    ("pipeline", "times_p"): lambda s: f"every weight is P = {s.size} times too large: does your schedule average its "
                                       "microbatches' losses? then audit with --pipeline-combine mean",
    ("pipeline", "unit_mean"): lambda s: "every token of a pipeline microbatch gets the same weight, set by its own "
                                         "token count (a per-microbatch mean); divide by the global count num_tokens "
                                         "instead",
}


def skew_clause(report: Report, skew: Skew) -> str:
    """One axis's clause: invariant without it, skewed by how much under it, and why when the cause is known."""
    if skew.axis == "budget":
        return (f"{BUDGET_LEAD} (ranks hold {skew.size} to {skew.most} microbatches) every token of rank r weighs "
                f"1/A_r times its weight in one process, skewed by up to {skew.change:.1%}: your loss or loop "
                f"divides by this rank's number of microbatches A_r, which a token budget makes differ by rank; "
                f"divide by the global counts alone")
    where = f", where it equals {_like(report, skew.mode)}" if skew.mode else ""
    if skew.axis == "counts":
        unit = "pairs" if report.objective.unit == "pair" else "sequences"
        return (f"invariant whenever every microbatch holds the same number of {unit}{where}; skewed by up to "
                f"{percent(skew.change, report.tol)} when they do not (under {', '.join(skew.where)})"
                + (f"; if your trainer's microbatches hold a fixed number of {unit}, audit with --sharding "
                   f"{' '.join(skew.even)}{' and no --microbatch-tokens' if skew.budget else ''}" if skew.even else ""))
    lead, under = AXIS_WORDS[skew.axis](skew, report.convention)
    text = f"{lead}{where}; skewed by up to {skew.change:.1%} {under}"
    return f"{text}: {CAUSES[skew.axis, skew.cause](skew)}" if skew.cause else text


def axis_clauses(report: Report) -> list[str]:
    """One clause for each axis the loss is skewed by alone (none when it is skewed without any)."""
    return [skew_clause(report, s) for s in diagnose(report).skews if s.axis != "counts"]


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
