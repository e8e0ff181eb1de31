"""Run each multi-process command the pages show many times in a row, as typed, and count the exits.

    .venv/bin/python -m tests.helpers.repeat_commands                    # every command, 10 runs; the examples 20
    .venv/bin/python -m tests.helpers.repeat_commands --runs 3 --only drop_in

A launch that fails now and then (a worker aborting at exit, a rendezvous that times out) passes a
single test by chance; this says how often each command a user copies exits 0. Each command is read
off its page (tests/helpers/documented.py), its made-up output directories moved into a fresh
temporary directory per run, and run by bash from the repository root with this Python's bin/ first
on PATH, as tests/project/test_documented_commands.py runs it once. CPU-heavy: minutes on 2 cores.
Prints one line per command: ``k of n exit 0`` (``exit 1`` for the audits of a skewed trainer, as the
pages promise), then the last line of each other run's output.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tests.helpers import ROOT
from tests.helpers.documented import documented, fill, finish, make_options, shown, typed

Prepare = Callable[[Path], list[str]]  # a fresh directory -> the commands of one run (the last one is counted)


def plan() -> dict[str, tuple[Prepare, int, int]]:
    """name -> (how to build one run's commands, the default number of runs, the exit status the page promises:
    the audits of a skewed trainer exit 1)."""
    commands = documented(ROOT)

    def one(page: str, *needles: str) -> str:
        (text,) = shown(commands, page, *needles)
        return text

    demo = one("README.md", "DEMO_FLAGS=")
    w2, local = shown(commands, "docs/training.md", "torchrun", inline=False)
    build, train = shown(commands, "docs/huggingface.md", "tiny-llama", inline=False)
    group = one("README.md", "examples/drop_in_ddp.py --denominator group")
    script = one("docs/audit.md", "--script -- torchrun")
    trainer = one("docs/audit.md", "--trainer examples/trainers/hf_trainer.py:build_dropping")
    found = {
        "make demo (the suite's DEMO_FLAGS)": (
            lambda tmp: [fill(demo, {"make ": "make " + make_options(ROOT), "DIR": f"{tmp}/grpo"})], 10, 0),
        "docs/training.md: token on 2 ranks": (lambda tmp: [fill(w2, {"runs/": f"{tmp}/runs/"})], 10, 0),
        "docs/training.md: local on 2 ranks": (lambda tmp: [fill(local, {"runs/": f"{tmp}/runs/"})], 10, 0),
        "docs/huggingface.md: the tiny Llama on 2 ranks": (
            lambda tmp: [fill(build, {"runs/": f"{tmp}/runs/"}), fill(train, {"runs/": f"{tmp}/runs/"})], 10, 0),
        "README: drop_in_ddp.py --denominator group": (lambda tmp: [group], 10, 0),
        "docs/audit.md: --script -- torchrun (SKEWED)": (lambda tmp: [script], 10, 1),
        "docs/audit.md: --trainer build_dropping (SKEWED)": (lambda tmp: [trainer], 10, 1),
    }
    launcher = "OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2"  # the README's, for the examples
    for name in ("ddp", "sft", "dpo"):  # as the README shows them: its launcher and no flags
        found[f"README: drop_in_{name}.py"] = (lambda tmp, name=name: [f"{launcher} examples/drop_in_{name}.py"], 20, 0)
    return found


def last_line(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def repeat(prepare: Prepare, runs: int, expected: int) -> tuple[int, list[str], float]:
    """(runs that exited ``expected``, the last line of each other run, mean seconds per run)."""
    passed, failures, start = 0, [], time.monotonic()
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="repeat-") as tmp:
            *setup, counted = prepare(Path(tmp))
            for command in setup:
                done = finish(typed(command, ROOT))
                if done.returncode != 0:
                    break
            else:
                done = finish(typed(counted, ROOT))
            if done.returncode == expected:
                passed += 1
            else:
                failures.append(f"exit {done.returncode}: {last_line(done)}")
    return passed, failures, (time.monotonic() - start) / max(runs, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, help="runs of every command (default: 10, and 20 for the examples)")
    parser.add_argument("--only", nargs="*", default=[], help="only the commands whose name holds one of these")
    args = parser.parse_args(argv)
    every_run_passed = True
    for name, (prepare, default, expected) in plan().items():
        if args.only and not any(word in name for word in args.only):
            continue
        runs = args.runs or default
        passed, failures, seconds = repeat(prepare, runs, expected)
        every_run_passed &= passed == runs
        print(f"{name}: {passed} of {runs} exit {expected} ({seconds:.1f} s a run)", flush=True)
        for failure in failures:
            print(f"    {failure}", flush=True)
    return 0 if every_run_passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
