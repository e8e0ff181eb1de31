"""The command ``python -m gradnorm.audit LOSS``: flags in, a table and a verdict out.

Exit status: 0 invariant (and no weight outside the mask), 1 skewed or leaking, 2 one
``error: ...`` line on stderr (an unimportable loss, a broken contract, bad flags), no traceback.
``main(argv)`` is importable, so a notebook or a test can run the command in-process.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from gradnorm.audit import COUNTS, MODES, ContractError, Convention, Report, audit, load_loss
from gradnorm.core.sharding import SHARD_KINDS


def verdict(report: Report) -> str:
    """One sentence: invariant or skewed, leaking or not, and the mode it equals."""
    how = "SKEWED" if not report.invariant else "LEAKS" if report.leaks else "INVARIANT"
    parts = [f"{how}: a token's weight changes by up to {report.change:.1%} across configurations"]
    if report.leaks:
        parts.append(f"{report.leak:.1%} of the weight LEAKS onto tokens outside the mask")
    if report.equals == "constant":
        parts.append(f"equals a constant denominator C = {report.constant:.6g}")
    elif report.equals:
        parts.append(f"equals gradnorm's `{report.equals}`")
    else:
        parts.append("equals no gradnorm mode")
    return "; ".join(parts)


def format_report(report: Report) -> str:
    """The command's output: the minibatch, a row per configuration, distances, the verdict."""
    b, conv = report.batch, report.convention
    lengths = b.mask.sum(-1)
    loop = "loss / A" if conv.scale_by_accum else "loss as returned"
    lines = [f"audit of {report.name}",
             f"minibatch: {len(lengths)} responses in {b.num_groups} groups of {b.group_size}, "
             f"{int(lengths.min())} to {int(lengths.max())} tokens (N = {int(lengths.sum())}); "
             f"backward of {loop}, gradients {conv.reduction}-reduced over ranks",
             f"{'W':>3} {'A':>3}  {'sharding':<22} {'max change':>10}  loudest rank: update share / token share"]
    for r in report.results:
        k = int(torch.argmax(r.update_share / r.token_share))
        lines.append(f"{r.world_size:>3} {r.accum_steps:>3}  {r.label:<22} {r.change:>10.1%}  "
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
    rows = [f"{'loss':<36} {'verdict':<9} {'max change':>10} {'leak':>6}  equals"]
    for r in reports:
        equals = f"constant C = {r.constant:.6g}" if r.equals == "constant" else (r.equals or "-")
        how = "SKEWED" if not r.invariant else "LEAKS" if r.leaks else "invariant"
        rows.append(f"{r.name:<36} {how:<9} {r.change:>10.1%} "
                    f"{r.leak:>6.1%}  {equals}")
    return "\n".join(rows)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block: the CLI's errors all look alike
        raise ContractError(message)


def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value
    return parse


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a relative tolerance in [0, 1), got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m gradnorm.audit",
        description="Measure the weight a GRPO microbatch loss gives every token under simulated data "
                    "parallelism and gradient accumulation, and say whether it is invariant to W, A and sharding.",
        epilog="LOSS(logp, old_logp, advantages, mask, **counts) returns the scalar you backpropagate; it gets, by "
               f"keyword name, any of: {', '.join(COUNTS)}. Exit status: 0 invariant, 1 skewed or leaking onto "
               "tokens outside the mask, 2 an error (one line).",
    )
    p.add_argument("loss", help="package.module:function or path/to/file.py:function")
    p.add_argument("--world-size", type=_at_least(1), nargs="+", default=[8], help="W, one or more (default 8)")
    p.add_argument("--accum-steps", type=_at_least(1), nargs="+", default=[4], help="A, one or more (default 4)")
    p.add_argument("--sharding", choices=SHARD_KINDS, nargs="+", default=list(SHARD_KINDS),
                   help="how sequences are assigned to ranks and microbatches (default: all)")
    p.add_argument("--scale-by-accum", action="store_true",
                   help="the trainer divides each microbatch's loss by A before backward (default: no)")
    p.add_argument("--reduction", choices=("mean", "sum"), default="mean",
                   help="how gradients combine over ranks: DDP's mean (default) or a sum")
    p.add_argument("--group-size", type=_at_least(2), default=8, help="G completions per prompt (default 8)")
    p.add_argument("--max-new-tokens", type=_at_least(1), default=64, help="the longest response (default 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic minibatch (default 0)")
    p.add_argument("--tol", type=_tolerance, default=1e-6, help="relative tolerance of every comparison (default 1e-6)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The command: print the table and the verdict; exit 0 invariant, 1 skewed, 2 error."""
    try:
        args = _parser().parse_args(argv)
        loss_fn = load_loss(args.loss)
        report = audit(loss_fn, args.world_size, args.accum_steps, args.sharding,
                       Convention(args.scale_by_accum, args.reduction), args.group_size, args.max_new_tokens,
                       args.seed, name=args.loss, tol=args.tol)
    except ContractError as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(format_report(report))
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
