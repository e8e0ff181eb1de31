"""The trainer's CLI (argparse, generated from TrainConfig's source) against tyro, side by side.

    pip install tyro                              # the candidate; the library does not need it
    python benchmarks/cli_parsers.py              # prints the table
    python benchmarks/cli_parsers.py --out benchmarks --rounds 10   # also writes cli_parsers.md

What the trainer's CLI promises, checked for both parsers on the same TrainConfig:

- bad input is one ``error: ...`` line on stderr with exit code 2 (six bad command lines that
  argparse itself rejects: tests/reliability/test_bad_input.py and tests/unit/trainer/test_train_unit.py hold the others,
  which ``TrainConfig.validate`` rejects after either parser);
- ``--help`` prints the range of every numeric field (``BOUNDS``). tyro reads the field
  docstrings itself; the range reaches its help only through an ``Annotated[int,
  tyro.conf.arg(help_behavior_hint=...)]`` on each field, which the prototype puts in place;
- what ``--help`` costs: a fresh interpreter that imports ``gradnorm.trainer.config`` and prints
  the help, the two run interleaved in rounds (a noisy neighbour slows both alike); and the cost of
  importing each parser alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ARGPARSE = """
import sys
from gradnorm.trainer.config import build_parser, TrainConfig
cfg = TrainConfig(**vars(build_parser("train.py").parse_args(sys.argv[1:])))
"""

TYRO = """
import sys
from typing import Annotated, get_type_hints
import tyro
from gradnorm.trainer.config import BOUNDS, TrainConfig
hints = get_type_hints(TrainConfig)
for name, allowed in BOUNDS.items():  # what `Annotated[int, tyro.conf.arg(...)]` on each field would do
    TrainConfig.__annotations__[name] = Annotated[
        hints[name], tyro.conf.arg(help_behavior_hint=lambda d, r=allowed: f"(default: {d}, range: {r})")]
cfg = tyro.cli(TrainConfig, args=sys.argv[1:], prog="train.py")
"""

VALIDATE = """
try:
    cfg.validate()
except ValueError as err:  # what gradnorm/train.py does with it
    sys.stderr.write(f"error: {err}\\n")
    raise SystemExit(2)
"""
PARSERS = {"argparse": ARGPARSE + VALIDATE, "tyro": TYRO + VALIDATE}
# tyro's one switch for its error box: console_outputs=False, meant to silence it (the table shows what it does)
QUIET = {"tyro, console_outputs=False":
         (TYRO + VALIDATE).replace('prog="train.py")', 'prog="train.py", console_outputs=False)')}
BAD = [["--steps", "1e3"], ["--group-size", "x"], ["--bogus", "3"], ["--shard", "diagonal"], ["--lr"],
       ["--resume", "yes"]]
IMPORTS = {"argparse": "import argparse, ast, inspect, textwrap", "tyro": "import tyro"}


def run(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "COLUMNS": "100"}
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, cwd=ROOT)


def contract(name: str) -> tuple[list[str], int]:
    """Table rows for the bad inputs, and how many of BOUNDS' ranges --help prints."""
    from gradnorm.trainer.config import BOUNDS

    rows = []
    for argv in BAD:
        proc = run({**PARSERS, **QUIET}[name], *argv)
        lines = proc.stderr.strip().splitlines()
        one_line = proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ")
        content = [text for line in lines if (text := line.strip(" │╭─╮╰╯"))]
        first = " / ".join(content[:2])  # tyro: the box's title, then its first line
        rows.append(f"| {name} | `{' '.join(argv)}` | {proc.returncode} | {len(lines)} | "
                    f"{'yes' if one_line else 'no'} | {first[:90]} |")
    if name in QUIET:
        return rows, 0
    help_text = " ".join(run(PARSERS[name], "--help").stdout.replace("│", " ").split())  # unwrapped
    shown = sum(str(allowed) in help_text for allowed in BOUNDS.values())
    return rows, shown


def timings(rounds: int) -> dict[str, list[float]]:
    jobs = {f"{name} --help": (PARSERS[name], "--help") for name in PARSERS}
    jobs |= {f"import {name} alone": (IMPORTS[name],) for name in IMPORTS}
    jobs["python -c pass"] = ("pass",)
    times = {job: [] for job in jobs}
    for r in range(rounds):
        order = list(jobs)[r % len(jobs):] + list(jobs)[:r % len(jobs)]  # rotated every round
        for job in order:
            start = time.perf_counter()
            run(*jobs[job])
            times[job].append(time.perf_counter() - start)
    return times


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--rounds", type=int, default=10)
    cli.add_argument("--out", type=Path, default=None, help="write cli_parsers.md here")
    args = cli.parse_args()
    sys.path.insert(0, str(ROOT))
    import tyro
    from gradnorm.trainer.config import BOUNDS

    load_before = os.getloadavg()[0]
    rows, shown = [], {}
    for name in [*PARSERS, *QUIET]:
        r, shown[name] = contract(name)
        rows += r
    times = timings(args.rounds)
    load_after = os.getloadavg()[0]
    lines = [
        "# The trainer's CLI: argparse generated from TrainConfig against tyro",
        "",
        f"Generated by `python benchmarks/cli_parsers.py --rounds {args.rounds} --out benchmarks` (tyro "
        f"{tyro.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average "
        f"{load_before:.1f} before, {load_after:.1f} after).",
        "",
        "Bad input (the contract: exit code 2 and one `error:` line on stderr):",
        "",
        "| parser | command line | exit code | stderr lines | one `error:` line | first line |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"Ranges of BOUNDS printed by `--help`: argparse {shown['argparse']} of {len(BOUNDS)}, tyro "
        f"{shown['tyro']} of {len(BOUNDS)} (tyro only with `Annotated[..., tyro.conf.arg(help_behavior_hint=...)]` "
        "on every numeric field).",
        "",
        f"Seconds, median (min) of {args.rounds} interleaved rounds, a fresh interpreter each:",
        "",
        "| command | median s | min s |",
        "|---|---|---|",
        *(f"| {job} | {statistics.median(t):.3f} | {min(t):.3f} |" for job, t in times.items()),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        (args.out / "cli_parsers.md").write_text(text)


if __name__ == "__main__":
    main()
