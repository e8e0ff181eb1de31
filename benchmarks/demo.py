"""The README's "what the main job learns" numbers, measured: `make demo` and one plain process.

    python benchmarks/demo.py                      # prints the block (about 2 minutes on 2 cores)
    python benchmarks/demo.py --readme README.md   # and rewrites it between the README's demo markers

Runs the main job exactly as ``make demo`` does (``torchrun --standalone --nproc_per_node=2
gradnorm/train.py --device cpu``, default flags, seed 0) and the one-process run
(``python gradnorm/train.py``), each into a temporary directory, and reads every number from
their ``warmup.json`` and ``metrics.jsonl``: the sampled reward before and after the warm-up, at
GRPO step 1 and over the last 10 steps, the wall time, and where the 2-rank run's GRPO time went
(the sums of its phase times). Nothing in the block is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gradnorm.teach.launch import torchrun_command  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
BEGIN, END = "<!-- demo:begin (written by python benchmarks/demo.py --readme README.md) -->", "<!-- demo:end -->"


def run(cmd: list[str], out: Path) -> dict:
    """Run one training; its warm-up record, its metrics lines and its wall time."""
    t0 = time.perf_counter()
    proc = subprocess.run([*cmd, "--output-dir", str(out)], cwd=ROOT, env=ENV, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"warmup": json.loads((out / "warmup.json").read_text()), "rows": rows, "wall_s": wall}


def block(two: dict, one: dict, load: float) -> str:
    rows, last = two["rows"], two["rows"][-10:]
    warm = two["warmup"]
    phases = {p: sum(r[f"time_{p}_s"] for r in rows) for p in ("rollout", "forward_backward", "counts")}
    return "\n".join([
        BEGIN,
        "Measured on a 2-core machine (default flags, seed 0; load average "
        f"{load:.1f} at the start; the 2-rank rows are `make demo`, the one-process row `python gradnorm/train.py`, "
        "both read from their `metrics.jsonl` and `warmup.json` by `python benchmarks/demo.py`, which rewrites "
        "this block):",
        "",
        "| | sampled mean reward (max 1) |",
        "|---|---|",
        f"| random initialization | {warm['reward_before']:.3f} |",
        f"| after the {warm['steps']}-step warm-up | {warm['reward_after']:.3f} |",
        f"| GRPO step 1 | {rows[0]['reward_mean']:.3f} |",
        f"| mean of the last 10 of {len(rows)} GRPO steps, 2 ranks | **{statistics.mean(r['reward_mean'] for r in last):.3f}** "
        f"({statistics.mean(r['exact_match'] for r in last):.0%} exactly right) |",
        f"| the same, one process | {statistics.mean(r['reward_mean'] for r in one['rows'][-10:]):.3f} |",
        "",
        f"`make demo` took {two['wall_s']:.0f} s of wall time ({rows[-1]['elapsed_s']:.0f} s of GRPO, a median of "
        f"{statistics.median(r['tokens_per_second'] for r in rows) / 1e3:.0f}k response tokens per second); one process "
        f"took {one['wall_s']:.0f} s ({one['rows'][-1]['elapsed_s']:.0f} s of GRPO). The phase times in `metrics.jsonl` "
        f"say where the 2-rank run's GRPO went: {phases['rollout']:.0f} s sampling, {phases['forward_backward']:.0f} s "
        f"forward and backward, {phases['counts']:.1f} s at the count all-reduce (mostly waiting for the other rank to "
        "finish sampling).",
        END,
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--readme", type=Path, help="rewrite the block between the demo markers of this file")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="gradnorm-demo-") as tmp:
        print("make demo's run (2 ranks) ...", file=sys.stderr, flush=True)
        two = run(torchrun_command(2, "--device", "cpu"), Path(tmp) / "two")
        print("one process ...", file=sys.stderr, flush=True)
        one = run([sys.executable, "gradnorm/train.py"], Path(tmp) / "one")
    text = block(two, one, load)
    print(text)
    if args.readme:
        readme = args.readme.read_text()
        pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
        if not pattern.search(readme):
            raise SystemExit(f"error: {args.readme} has no demo markers ({BEGIN} ... {END})")
        args.readme.write_text(pattern.sub(lambda _: text, readme))
    return 0


if __name__ == "__main__":
    sys.exit(main())
