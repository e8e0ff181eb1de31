"""The command ``python -m gradnorm.audit LOSS``: flags in, a table and a verdict out.

Exit status: 0 invariant (and no weight outside the mask), 1 skewed (the loss or one of its named
terms), leaking or of the wrong sign (a negative weight on a counted token), 2
one ``error: ...`` line on stderr (an unimportable loss, a broken contract, bad flags, a run with
nothing to compare), no traceback.
``main(argv)`` is importable, so a notebook or a test can run the command in-process.

This module holds the flags and ``main`` only: the audit itself is ``gradnorm.audit.decide``'s,
the words of its output ``gradnorm.audit.verdict``'s.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import multiprocessing
import os
import signal
import sys
import textwrap
from collections.abc import Sequence

from gradnorm.audit.contract import ContractError, imported_loss
from gradnorm.audit.decide import audit
from gradnorm.audit.masking import COUNT_MASKED
from gradnorm.audit.measurement import Convention
from gradnorm.audit.objectives import DEFAULT_BETA, DPO, GRPO, OBJECTIVES, SFT
from gradnorm.audit.splits import CP_LAYOUTS, Splits
from gradnorm.audit.synthetic import minibatch_size
from gradnorm.audit.verdict import format_report
from gradnorm.cli.oneline import OneLineParser
from gradnorm.cli.usercode import describe
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


DEFAULT_TIMEOUT = 600.0
"""Seconds the command waits for the audit's child: a hang in the loss ends the command, not the CI job."""


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 86400:
        raise argparse.ArgumentTypeError(f"expected seconds in (0, 86400], got {text!r}")
    return value


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a relative tolerance in [0, 1), got {text!r}")
    return value


def _beta(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


OBJECTIVE_HELP = {
    "grpo": "a policy-gradient loss over sampled responses (GRPO, DAPO, Dr GRPO, PPO-style), read on policy, "
            "with both signs of the advantages",
    "sft": "a supervised (cross-entropy) loss over label tokens; logp holds log p(label), mask the label tokens "
           "(labels != -100)",
    "dpo": "a pair loss over chosen and rejected responses (DPO, IPO-style, length-normalized DPO, SimPO), read "
           "at pi = pi_ref where -log sigmoid(beta * m) has slope beta/2; every split keeps a pair together",
}

STEP_CONTRACT = ("--step: LOSS is instead a rank's step, STEP(microbatches, *, world_size, rank), that runs your "
                 "loop over the rank's microbatches and calls backward itself, scaled as your loop scales (a "
                 "division by the accumulation steps, a token share); each microbatch is a dict of the "
                 "objective's arguments above and its counts by name. The audit only reduces over ranks.")


def _parser() -> argparse.ArgumentParser:
    contracts = "\n".join(
        textwrap.fill(f"--objective {o.name} ({OBJECTIVE_HELP[o.name]}): {o.describe()}.", 100,
                      initial_indent="  ", subsequent_indent="    ") for o in (GRPO, SFT, DPO))
    contract = f"the loss, by objective:\n{contracts}\n\n{textwrap.fill(STEP_CONTRACT, 100)}\n\n" + textwrap.fill(
        "A loss may return a dict of named scalar terms ({'pg': ..., 'kl': ..., 'nll': ...}) instead of one "
        "scalar: each term is audited apart, and the total is their sum.", 100)
    shardings = "\n".join(textwrap.fill(f"{kind}: {SHARDINGS[kind]}", 100, initial_indent="  ",
                                       subsequent_indent="    ") for kind in SHARD_KINDS)
    status = ("Exit status: 0 invariant; 1 skewed, leaking onto tokens outside the mask, or of the wrong sign (the "
              "loss rises where the advantage is positive); 2 an error (one line), also for a run with nothing to "
              "compare (W = A = 1 only).")
    p = OneLineParser(
        prog="python -m gradnorm.audit",
        raises=ContractError,  # one line, no usage block: main reports it as every other error
        description=textwrap.fill("Measure the weight a GRPO, SFT or DPO microbatch loss (or a rank's step) gives "
                                  "every token under simulated data parallelism and gradient accumulation, and say "
                                  "whether it is invariant to W, A and sharding, and if not, why. Choose the "
                                  "objective with --objective (default grpo).", 100),
        epilog=f"{contract}\n\nshardings (S sequences, W ranks, A microbatches a rank):\n"
               f"{shardings}\n\n{textwrap.fill(status, 100)}",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keeps the epilog's list of shardings
    )
    p.add_argument("loss", help="package.module:function or path/to/file.py:function")
    p.add_argument("--objective", choices=OBJECTIVES, default="grpo",
                   help="what LOSS computes, and so what it is called with (below): grpo (default), sft or dpo")
    p.add_argument("--beta", type=_beta, default=DEFAULT_BETA,
                   help=f"dpo: the beta the loss uses, offered to it as `beta` (default {DEFAULT_BETA:g})")
    p.add_argument("--step", action="store_true",
                   help="LOSS is a rank's step over its microbatches that calls backward itself (below)")
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
                   help="grpo: add truncated responses (one a group) and tokens a rejection mask drops, and declare which "
                        "of them your loss should count (none: both are dropped, from the sum and from every count)")
    p.add_argument("--group-size", type=_at_least(2, 4096), default=8,
                   help="grpo, sft: G completions per prompt (default 8)")
    p.add_argument("--max-new-tokens", type=_at_least(1, 2**16), default=64, help="the longest response (default 64)")
    p.add_argument("--seed", type=_at_least(0), default=0, help="seed of the synthetic minibatch (default 0)")
    p.add_argument("--tol", type=_tolerance, default=1e-6, help="relative tolerance of every comparison (default 1e-6)")
    p.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                   help=f"python -m gradnorm.audit: give up, with no verdict, when the audit (the loss's import and "
                        f"every call) has not finished in SECONDS (default {DEFAULT_TIMEOUT:g})")
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


INTERRUPTED = 130
"""Exit status after a real Ctrl-C (128 + SIGINT), as for the trainer."""
TERMINATED = 143
"""Exit status after a SIGTERM (128 + 15): a CI job's timeout; the loss's child goes with the command."""
REAPED_AFTER = 5.0
"""Seconds the command waits for the child to end after its report came: a thread the loss started that
never ends (not a daemon) must not hold the command, nor the child outlive it."""


class _CtrlC(BaseException):
    """A real Ctrl-C. Not a KeyboardInterrupt, so that the user-code guard (which reports a
    KeyboardInterrupt the loss raises itself as the loss's failure, exit 2) lets it through."""


class _Terminated(BaseException):
    """A SIGTERM to the command, raised where the parent waits, so that its ``finally`` ends the child."""


def _on_ctrl_c(signum, frame):
    raise _CtrlC


def _on_term(signum, frame):
    raise _Terminated


def main(argv: Sequence[str] | None = None, isolate: bool = False) -> int:
    """The command: print the table and the verdict; exit 0 invariant, 1 skewed, leaking or wrong-signed, 2 error,
    130 on Ctrl-C.

    ``isolate`` (``python -m gradnorm.audit``) runs the user's code in a child process, so that an
    ``os._exit``, a crash in C code or a signal in it ends the child, not the command: the parent
    prints a verdict only from a report the child sent, and otherwise one line, exit 2.
    """
    previous = {}
    for signum, handler in ((signal.SIGINT, _on_ctrl_c), (signal.SIGTERM, _on_term)):
        try:
            previous[signum] = signal.signal(signum, handler)
        except ValueError:  # not the main thread: leave the signals as they are
            pass
    try:
        return _isolated(argv) if isolate else _run(argv)
    except _CtrlC:
        print("error: interrupted (Ctrl-C): no report", file=sys.stderr)
        return INTERRUPTED
    except _Terminated:
        print("error: terminated (SIGTERM): no report", file=sys.stderr)
        return TERMINATED
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _isolated(argv: Sequence[str] | None) -> int:
    """``_run`` in a child process; what it printed (the report, or its one error line) comes back
    through a pipe, or nothing came."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        timeout = _parser().parse_args(argv).timeout  # --help and bad flags answer here, at once, without a child
    except ContractError as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    # fork: the child starts at once with what is imported (nothing ran torch yet); spawn where there is no fork
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(argv, send), daemon=True)
    child.start()
    send.close()
    try:
        if not receive.poll(timeout):
            child.kill()
            child.join()
            print(f"error: the audited code did not finish in {timeout:g} s (--timeout): no verdict (a loss that "
                  "waits on a collective, a lock or input never returns)", file=sys.stderr)
            return 2
        try:
            printed, said, code = receive.recv()
        except EOFError:  # the child ended without a report
            printed, said, code = None, "", None
        child.join(REAPED_AFTER if printed is not None else None)  # a report in hand: a stuck exit is not waited on
    finally:
        if child.is_alive():  # Ctrl-C or SIGTERM in the parent, or a child stuck after its report: it goes too
            child.kill()
            child.join()
    if printed is None:
        ended = child.exitcode
        how = (f"was killed by {signal.Signals(-ended).name}" if ended is not None and ended < 0
               else f"exited with code {ended} (os._exit in the loss or at its import?)")
        print(f"error: the audited code's process {how} before it sent a report: no verdict", file=sys.stderr)
        return 2
    sys.stderr.write(said)
    sys.stdout.write(printed)
    sys.stdout.flush()
    return code


class _Kept(io.StringIO):
    """What the child prints: a loss that closes sys.stdout (or stderr) closes nothing the report needs."""

    def close(self) -> None:
        pass


def _child(argv: list[str], send) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent takes Ctrl-C, and ends this process
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's handler is not this process's: a SIGTERM ends it
    printed, said = _Kept(), _Kept()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(said):  # the loss's own prints come too
        try:
            code = _run(argv)
        except BaseException as err:  # the audit's own failure (user code's is a ContractError inside _run)
            said.write(f"error: the audit failed: {describe(err)}; no verdict\n")
            code = 2
    send.send((printed.getvalue(), said.getvalue(), code))
    send.close()
    # The report is sent: end here, so that a thread the loss left running (not a daemon) cannot hold the
    # process in the interpreter's shutdown, which joins every such thread.
    os._exit(0)


def _run(argv: Sequence[str] | None) -> int:
    try:
        args = _parser().parse_args(argv)
        splits = _splits(args)
        unit = 2 if args.objective == "dpo" else 1  # a pair is two rows
        group = 1 if args.objective == "dpo" else args.group_size
        sizes = [w * a for w in args.world_size for a in args.accum_steps]
        cells = unit * minibatch_size([s * splits.granularity for s in sizes], group) * args.max_new_tokens
        if cells > MAX_CELLS:  # the least common multiple of the layouts sets the minibatch: it grows fast
            what = " x --pipeline-microbatches" if splits.granularity > 1 else ""
            raise ContractError(f"--world-size x --accum-steps{what} x --group-size x --max-new-tokens ask for a "
                                f"minibatch of {cells} tokens (more than {MAX_CELLS}); audit fewer or smaller layouts")
        if args.pack and max(sizes) * args.pack > MAX_CELLS:  # every microbatch gets rows of --pack positions
            raise ContractError(f"--pack {args.pack} gives each of up to {max(sizes)} microbatches rows of {args.pack} "
                                f"positions, more than {MAX_CELLS} in all; pack into shorter rows")
        convention = Convention(args.scale_by_accum, args.reduction, args.cp_reduction or "mean",
                                args.pipeline_combine or "sum")
        with imported_loss(args.loss) as loss_fn:  # a file's neighbours stay importable until the audit ends
            report = audit(loss_fn, args.world_size, args.accum_steps, args.sharding, convention, args.group_size,
                           args.max_new_tokens, args.seed, name=args.loss, tol=args.tol, splits=splits,
                           count_masked=args.count_masked, objective=args.objective, beta=args.beta,
                           step=args.step)
    except ContractError as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(format_report(report))
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
