"""``python -m gradnorm.audit --trainer FILE.py:build`` and ``python -m gradnorm.audit --script -- COMMAND``.

The trainer audit's command (``gradnorm/audit/__main__.py`` hands it every command line that holds
``--trainer`` or ``--script``). It prints progress, then the loss audit's report of the trainer
(``gradnorm.audit.trainer.audit``) and what only a trainer run shows: the total weight of each
configuration against the reference's (a scale error: every gradient k times too large), the
gradient outside the data's tokens, ranks that stepped with different gradients.

Exit status: 0 invariant, 1 skewed (or mis-scaled, or ranks disagree), 2 one ``error: ...`` line
(a build that returns no trainer, a trainer that never steps or steps early, a script that never
loads the probe, a run that fails or passes --timeout), no traceback. Every file lives in the
audit's temporary folder, removed at the end (``--keep DIR`` keeps them in DIR).
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from gradnorm.audit.objectives import DEFAULT_BETA
from gradnorm.audit.verdict import format_report
from gradnorm.cli.oneline import OneLineParser
from gradnorm.audit.trainer.audit import TrainerReport, audit_script, audit_trainer
from gradnorm.audit.trainer.generated import GeneratedReport
from gradnorm.audit.trainer.launch import TrainerError
from gradnorm.audit.trainer.worker import BUILD_KEYWORDS


class _Stopped(BaseException):
    """SIGTERM (a CI timeout): unwind, so that the running launch's process group is killed."""


def _stop(signum, frame):
    raise _Stopped


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return value
    return parse


def _parser() -> argparse.ArgumentParser:
    keywords = "; ".join(f"{k}: {v}" for k, v in BUILD_KEYWORDS.items())
    p = OneLineParser(prog="python -m gradnorm.audit --trainer BUILD | --script -- COMMAND",
                      description="Read every token's weight out of a real trainer, on real ranks, with a probe model.")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--trainer", metavar="FILE.py:build",
                     help="a function that returns a trainer with .train(); it may ask by name for: " + keywords)
    how.add_argument("--script", action="store_true",
                     help="run the command after -- as typed, {model}, {data} and {output_dir} filled in")
    p.add_argument("--objective", choices=("sft", "dpo", "grpo"), default="sft",
                   help="the probe data set: SFT texts ({'text'}), DPO pairs ({'prompt', 'chosen', 'rejected'}) or "
                        "GRPO prompts ({'prompt'}; --trainer only, the build takes reward_func)")
    p.add_argument("--world-size", type=_positive(int), nargs="+", default=[1, 2], metavar="W",
                   help="ranks of each configuration (--trainer; torchrun for W > 1)")
    p.add_argument("--accum-steps", type=_positive(int), nargs="+", default=[2], metavar="A",
                   help="gradient accumulation steps of each configuration (--trainer)")
    p.add_argument("--units", type=_positive(int), default=16,
                   help="sequences (SFT), pairs (DPO) or completions (GRPO) of one optimizer step")
    p.add_argument("--beta", type=_positive(float), default=DEFAULT_BETA, help="the DPO trainer's beta")
    p.add_argument("--timeout", type=_positive(float), default=300.0, help="seconds a launch may take")
    p.add_argument("--keep", type=Path, metavar="DIR", help="keep the probe, data and run files in DIR")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = []
    if "--" in argv:
        at = argv.index("--")
        argv, command = argv[:at], argv[at + 1:]
    args = _parser().parse_args(argv)
    if args.script and not command:
        print("error: --script runs the command after --, e.g. --script -- torchrun --nproc_per_node 2 train.py "
              "--model {model} --data {data}", file=sys.stderr)
        return 2
    if args.trainer and command:
        print("error: a command after -- goes with --script, not --trainer", file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
        if args.script:
            result = audit_script(command, args.objective, args.units, args.beta, args.timeout, args.keep, progress)
        else:
            result = audit_trainer(args.trainer, args.objective, args.world_size, args.accum_steps, args.units,
                                   args.beta, args.timeout, args.keep, progress)
    except TrainerError as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except _Stopped:
        print("error: stopped (SIGTERM): no report", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("error: interrupted (Ctrl-C): no report", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(format_trainer_report(result))
    return result.exit_code


def format_trainer_report(result: TrainerReport) -> str:
    """The whole report: the loss audit's (or a generating trainer's) and the trainer's own lines."""
    if isinstance(result.report, GeneratedReport):
        return result.report.format()
    return "\n".join([format_report(result.report), *trainer_lines(result)])


def trainer_lines(result: TrainerReport) -> list[str]:
    """What only a trainer run shows, in words: scale, stray gradient, ranks that disagree (SFT, DPO)."""
    report, lines = result.report, []
    if isinstance(report, GeneratedReport):
        return []  # its own report says each
    ref = float(report.results[0].weights.sum())
    for res in report.results[1:]:
        total = float(res.weights.sum())
        ratio = total / ref if ref else math.inf
        if abs(ratio - 1) > 1e-4:
            W, A = res.world_size, res.accum_steps
            named = {W * A: "W*A", W: "W", A: "A", 1 / A: "1/A", 1 / W: "1/W", 1 / (W * A): "1/(W*A)"}
            law = next((f" = {name}" for k, name in named.items() if k != 1 and abs(ratio - k) < 1e-4 * k), "")
            lines.append(f"scale: under {res.label} the weights sum to {ratio:.4g}{law} times the reference's: every "
                         "gradient that many times too large (a scale error, apart from any skew)")
    if result.stray > 1e-6:
        lines.append(f"stray: {100 * result.stray:.2g}% of the gradient falls on tokens the data set never labels "
                     "(a prompt or padding trained on?)")
    for label in result.ranks_disagree:
        lines.append(f"ranks disagree: under {label} the ranks stepped with different gradients (no all-reduce?)")
    return lines
