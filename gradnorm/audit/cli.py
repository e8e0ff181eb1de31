"""The command ``python -m gradnorm.audit LOSS``: flags in, a table and a verdict out.

Exit status: 0 invariant (and no weight outside the mask), 1 skewed, leaking or of the wrong
sign (a negative weight on a response token: the loss rises where the advantage is positive), 2
one ``error: ...`` line on stderr (an unimportable loss, a broken contract, bad flags, a run with
nothing to compare), no traceback.
``main(argv)`` is importable, so a notebook or a test can run the command in-process.
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
from collections.abc import Sequence

import torch

from gradnorm.audit import why
from gradnorm.audit.masking import COUNT_MASKED
from gradnorm.audit.probe import (
    COUNTS, MODES, ContractError, Convention, Near, Report, audit, imported_loss, minibatch_size,
)
from gradnorm.audit.splits import CP_LAYOUTS, Splits
from gradnorm.core.sharding import SHARD_KINDS


SHARDINGS = {
    "interleave": "sequence i goes to rank i mod W, and each rank cuts its sequences in order into A "
                  "microbatches: every prompt group is spread over the ranks; S/(W*A) sequences per microbatch.",
    "contiguous": "consecutive runs of the minibatch, S/(W*A) sequences per microbatch: whole prompt groups "
                  "stay together.",
    "length": "sorted by response length, then cut like contiguous: rank 0's first microbatch holds the "
              "shortest responses; the largest token imbalance with S/(W*A) sequences per microbatch.",
    "balanced": "packs by tokens, greedily: the longest response first, each into the microbatch with the fewest "
                "tokens so far; rank r takes microbatches r*A to r*A+A-1, so rank 0 takes the A longest "
                "responses and the ranks do not hold equal tokens (nor do microbatches when one response is "
                "longer than their mean); on ragged lengths the microbatches hold different numbers of "
                "sequences, as token-budget microbatches do.",
}
"""What each ``--sharding`` does (``gradnorm.core.sharding``), for ``--help``: the kinds keep the trainer's names."""

WRONG_SIGN = "your loss rises where the advantage is positive: you return the objective, or swapped logp and old_logp"


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
                       if convention.reduction == "mean" else ""))
    if q < 0:
        says.append(("divides by A once too often" if q == -1 else "divides by A twice too often")
                    + (" (counting the loop's division by A)" if convention.scale_by_accum else ""))
    if q > 0:
        says.append(("is missing a division by A" if q == 1 else "is missing two divisions by A")
                    + ("" if convention.scale_by_accum else " (if your loop divides by A, audit with --scale-by-accum)"))
    return says


def explain_factor(near: Near, convention: Convention, tol: float) -> str:
    """``up to a factor 1/W: your loss is missing the world-size factor W (...)``: the factor, then why."""
    readings = [" and ".join(_why(p, q, convention)) for p, q in near.powers]  # one per law that fits
    if near.powers and abs(abs(near.scale) - 1) > tol:  # a constant k besides W^p * A^q
        extra = f"weighs every token {abs(near.scale):.4g} times what `{near.mode}` gives"
        readings = [f"{r} and {extra}" if r else extra for r in readings]
    readings = [r for r in readings if r]  # k = -1 alone: the wrong sign, which the verdict says first
    text = f"up to a factor {factor_name(near, tol)}"
    if readings:
        text += ": your loss " + " or ".join(readings)
    if len(near.powers) > 1:
        text += " (audit with W != A to tell which)"
    return text


def _equal_counts_clause(report: Report) -> str:
    """Invariant on fixed-size microbatches, skewed only where sequence counts differ: say so, and how to narrow."""
    even = list(dict.fromkeys(r.label for r in report.results[1:] if r.equal_counts and not r.axes))
    uneven = [r for r in report.results[1:] if not r.equal_counts]
    mode = report.equals_at_equal_counts
    like = f"a constant denominator C = {report.constant:.6g}" if mode == "constant" else f"gradnorm's `{mode}`"
    where = f", where it equals {like}" if mode else ""
    return (f"invariant whenever every microbatch holds the same number of sequences{where}; skewed by up to "
            f"{max(r.change for r in uneven):.1%} when they do not (token-budget microbatches: "
            f"{' '.join(dict.fromkeys(r.label for r in uneven))})"
            + (f"; if your trainer's microbatches hold a fixed number of sequences, audit with --sharding "
               f"{' '.join(even)}" if even else ""))


def verdict(report: Report) -> str:
    """One line: wrong sign, skewed, leaking or invariant, and the mode it equals (or nearly equals)."""
    change = f"a token's weight changes by up to {report.change:.1%} across configurations"
    if report.wrong_sign:
        parts = [f"WRONG SIGN: {WRONG_SIGN} ({report.negative:.1%} of the weight inside the mask is negative)",
                 change]
    elif report.invariant and not report.leaks and report.masked and report.masked.counts_dropped:
        parts = [f"MISCOUNTS: {change}"]
    else:
        parts = [f"{'SKEWED' if not report.invariant else 'LEAKS' if report.leaks else 'INVARIANT'}: {change}"]
    axis_clauses = why.axis_clauses(report)
    parts += axis_clauses
    if report.skewed_only_by_unequal_counts and not any(c.startswith(why.BUDGET_LEAD) for c in axis_clauses):
        parts.append(_equal_counts_clause(report))
    if report.leaks:
        dropped = " or declared dropped (truncated responses, rejected tokens)" if report.masked else ""
        parts.append(f"{report.leak:.1%} of the weight LEAKS onto tokens outside the mask{dropped}")
    if report.masked:
        parts.append(why.masked_clause(report.masked))
    if report.equals == "constant":
        parts.append(f"equals a constant denominator C = {report.constant:.6g}")
    elif report.equals:
        parts.append(f"equals gradnorm's `{report.equals}`")
    elif report.near and not axis_clauses:  # an axis clause names the factor better
        mode = report.near.mode
        like = f"a constant denominator C = {report.constant:.6g}" if mode == "constant" else f"gradnorm's `{mode}`"
        parts.append(f"equals {like} {explain_factor(report.near, report.convention, report.tol)}")
    elif not report.skewed_only_by_unequal_counts and not axis_clauses:  # the clauses above name the mode
        parts.append("equals no gradnorm mode")
    return "; ".join(parts)


def format_report(report: Report) -> str:
    """The command's output: the minibatch, a row per configuration, distances, the verdict."""
    b, conv = report.batch, report.convention
    lengths = b.mask.sum(-1)
    loop = "loss / A" if conv.scale_by_accum else "loss as returned"
    axes = set().union(*(r.axes for r in report.results))
    if "cp" in axes:
        loop += f", context-parallel gradients {conv.cp_reduction}-reduced over each group"
    if "pipeline" in axes:
        loop += f", pipeline losses combined by {conv.pipeline_combine}"
    lengths = b.response.sum(-1)
    lines = [f"audit of {report.name}",
             f"minibatch: {len(lengths)} responses in {b.num_groups} groups of {b.group_size}, "
             f"{int(lengths.min())} to {int(lengths.max())} tokens (N = {int(b.mask.sum())}); "
             f"backward of {loop}, gradients {conv.reduction}-reduced over ranks"]
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
    dist = " | ".join(f"{m} {report.distance[m]:.2g}" for m in MODES)
    lines.append(f"distance to each mode: {dist} (C = {report.constant:.6g})")
    lines.append(f"weight outside the mask: {report.leak:.1%} of the total")
    if report.residual > report.tol:
        lines.append(f"note: part of the gradient does not scale with the advantages ({report.residual:.2g} of the "
                     f"surrogate's; a k1 KL, an entropy bonus?); the weights above exclude it")
    lines.append(f"verdict: {verdict(report)}")
    return "\n".join(lines)


def verdict_table(reports: Sequence[Report]) -> str:
    """One row per audited loss: invariant?, the largest change, leak, the mode it equals."""
    rows = [f"{'loss':<36} {'verdict':<10} {'max change':>10} {'leak':>6}  equals"]
    for r in reports:
        equals = f"constant C = {r.constant:.6g}" if r.equals == "constant" else (r.equals or "-")
        how = "WRONG SIGN" if r.wrong_sign else "SKEWED" if not r.invariant else "LEAKS" if r.leaks else "invariant"
        rows.append(f"{r.name:<36} {how:<10} {r.change:>10.1%} "
                    f"{r.leak:>6.1%}  {equals}")
    return "\n".join(rows)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block: the CLI's errors all look alike
        raise ContractError(message)


def _at_least(low: int, high: int = 2**63 - 1):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if not low <= value <= high:  # a seed past 2**63 overflows torch's; a huge W asks for gigabytes
            raise argparse.ArgumentTypeError(f"expected an integer in [{low}, {high}], got {text!r}")
        return value
    return parse


MAX_CELLS = 10**7
"""The largest synthetic minibatch (sequences x max-new-tokens) the audit builds: about 1 GB of tensors."""


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a relative tolerance in [0, 1), got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    contract = ("LOSS(logp, old_logp, advantages, mask, **counts) returns the scalar you backpropagate; it gets, by "
                f"keyword name, any of: {', '.join(COUNTS)}.")
    shardings = "\n".join(textwrap.fill(f"{kind}: {SHARDINGS[kind]}", 100, initial_indent="  ",
                                       subsequent_indent="    ") for kind in SHARD_KINDS)
    status = ("Exit status: 0 invariant; 1 skewed, leaking onto tokens outside the mask, or of the wrong sign (the "
              "loss rises where the advantage is positive); 2 an error (one line), also for a run with nothing to "
              "compare (W = A = 1 only).")
    p = _Parser(
        prog="python -m gradnorm.audit",
        description=textwrap.fill("Measure the weight a GRPO microbatch loss gives every token under simulated "
                                  "data parallelism and gradient accumulation, and say whether it is invariant "
                                  "to W, A and sharding, and if not, why.", 100),
        epilog=f"{textwrap.fill(contract, 100)}\n\nshardings (S sequences, W ranks, A microbatches a rank):\n"
               f"{shardings}\n\n{textwrap.fill(status, 100)}",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keeps the epilog's list of shardings
    )
    p.add_argument("loss", help="package.module:function or path/to/file.py:function")
    p.add_argument("--world-size", type=_at_least(1, 4096), nargs="+", default=[8], help="W, one or more (default 8)")
    p.add_argument("--accum-steps", type=_at_least(1, 4096), nargs="+", default=[4], help="A, one or more (default 4)")
    p.add_argument("--sharding", choices=SHARD_KINDS, nargs="+", default=list(SHARD_KINDS),
                   help="how sequences are assigned to ranks and microbatches, each described below (default: all)")
    p.add_argument("--scale-by-accum", action="store_true",
                   help="the trainer divides each microbatch's loss by A before backward (default: no)")
    p.add_argument("--reduction", choices=("mean", "sum"), default="mean",
                   help="how gradients combine over ranks: DDP's mean (default) or a sum")
    p.add_argument("--microbatch-tokens", type=_at_least(1), metavar="B",
                   help="also cut each rank's sequences greedily into microbatches of at most B response tokens "
                        "(ranks then hold different numbers of sequences and of microbatches)")
    p.add_argument("--pack", type=_at_least(1), metavar="L",
                   help="also pack each microbatch's responses back to back into rows of L positions; the loss "
                        "gets per-token advantages (n, L) and can ask for sequence_ids")
    p.add_argument("--context-parallel", type=_at_least(2), metavar="K",
                   help="also split each row's positions over K ranks; gradients are reduced over dp x cp ranks")
    p.add_argument("--cp-layout", choices=CP_LAYOUTS, nargs="+",
                   help="contiguous: K chunks in order; two-chunk: 2K chunks, rank i holding chunks i and "
                        "2K-1-i (default: both; needs --context-parallel)")
    p.add_argument("--cp-reduction", choices=("mean", "sum"),
                   help="how gradients combine over the K ranks of a context-parallel group (default mean; needs "
                        "--context-parallel)")
    p.add_argument("--pipeline-combine", choices=("sum", "mean"),
                   help="also cut each microbatch into P pipeline microbatches whose losses the schedule sums or "
                        "averages")
    p.add_argument("--pipeline-microbatches", type=_at_least(2), metavar="P",
                   help="P (default 2; needs --pipeline-combine)")
    p.add_argument("--count-masked", choices=COUNT_MASKED,
                   help="add truncated responses (one a group) and tokens a rejection mask drops, and declare which "
                        "of them your loss should count (none: both are dropped, from the sum and from every count)")
    p.add_argument("--group-size", type=_at_least(2, 4096), default=8, help="G completions per prompt (default 8)")
    p.add_argument("--max-new-tokens", type=_at_least(1, 2**16), default=64, help="the longest response (default 64)")
    p.add_argument("--seed", type=_at_least(0), default=0, help="seed of the synthetic minibatch (default 0)")
    p.add_argument("--tol", type=_tolerance, default=1e-6, help="relative tolerance of every comparison (default 1e-6)")
    return p


def _splits(args) -> Splits:
    """The axes the flags ask for, or a ContractError naming the flags that do not go together."""
    T = args.max_new_tokens
    if args.context_parallel is None and (args.cp_layout or args.cp_reduction):
        raise ContractError(f"--{'cp-layout' if args.cp_layout else 'cp-reduction'} needs --context-parallel K")
    if args.pipeline_combine is None and args.pipeline_microbatches:
        raise ContractError("--pipeline-microbatches needs --pipeline-combine sum|mean")
    if args.pack and args.context_parallel:
        raise ContractError("--pack with --context-parallel: the audit splits padded rows over a group, not "
                            "packed ones (THD); audit each alone")
    if args.pipeline_combine and args.microbatch_tokens:
        raise ContractError("--pipeline-combine with --microbatch-tokens: a token-budget microbatch may hold fewer "
                            "sequences than pipeline microbatches; audit each alone")
    for flag, value in (("--pack", args.pack), ("--microbatch-tokens", args.microbatch_tokens)):
        if value is not None and value < T:
            raise ContractError(f"{flag} {value} is below --max-new-tokens {T}: the longest response would not fit")
    if args.context_parallel and 2 * args.context_parallel > T:
        raise ContractError(f"--context-parallel {args.context_parallel} needs --max-new-tokens of at least "
                            f"{2 * args.context_parallel} (2K chunks of a row)")
    return Splits(args.microbatch_tokens, args.pack, args.context_parallel or 1,
                  tuple(args.cp_layout or CP_LAYOUTS),
                  (args.pipeline_microbatches or 2) if args.pipeline_combine else None)


def main(argv: Sequence[str] | None = None) -> int:
    """The command: print the table and the verdict; exit 0 invariant, 1 skewed, leaking or wrong-signed, 2 error."""
    try:
        args = _parser().parse_args(argv)
        cells = minibatch_size([w * a for w in args.world_size for a in args.accum_steps], args.group_size) * args.max_new_tokens
        if cells > MAX_CELLS:  # the least common multiple of the layouts sets the minibatch: it grows fast
            raise ContractError(f"--world-size x --accum-steps x --group-size x --max-new-tokens ask for a minibatch of "
                                f"{cells} tokens (more than {MAX_CELLS}); audit fewer or smaller layouts")
        splits = _splits(args)
        convention = Convention(args.scale_by_accum, args.reduction, args.cp_reduction or "mean",
                                args.pipeline_combine or "sum")
        with imported_loss(args.loss) as loss_fn:  # a file's neighbours stay importable until the audit ends
            report = audit(loss_fn, args.world_size, args.accum_steps, args.sharding, convention, args.group_size,
                           args.max_new_tokens, args.seed, name=args.loss, tol=args.tol, splits=splits,
                           count_masked=args.count_masked)
    except ContractError as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(format_report(report))
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
