"""Padded against packed microbatches and token budgets, side by side, on the trainer itself.

    python benchmarks/packing.py               # about ten minutes on 2 cores (make bench runs it)
    python benchmarks/packing.py --quick       # a smoke-sized run
    python benchmarks/packing.py --out DIR     # where packing.md and packing.json go

Four ways to split the same minibatch (the same rollouts, the same gradient to fp32 rounding):
padded with a fixed number of microbatches, ``--pack``, ``--microbatch-tokens B``, and both. Each
runs ``python gradnorm/train.py`` in its own process (one rank, no warm-up, a few GRPO steps), on
three models: the default TinyGPT on the built-in task, a wider 4x256 one, and the tiny random Qwen2
of ``examples/tiny_models.py`` on ``examples/arithmetic.jsonl``, whose left-padded prompts and
ragged answers are the padding packing removes. The configurations of a model run interleaved in
rounds, the order rotated every round, so a noisy neighbour slows them alike; each number is the
median over rounds of the median over steps (the first step left out), reported with its ratio to
the padded configuration of the same round set. Peak memory is the process's maximum RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
CONFIGS = {"padded": [], "pack": ["--pack"], "budget": ["--microbatch-tokens", "{budget}"],
           "pack + budget": ["--pack", "--microbatch-tokens", "{budget}"]}
# The child: the trainer's main(), then its peak RSS on one line (ru_maxrss is in KiB on Linux).
CHILD = ("import resource, sys; from gradnorm.train import main\n"
         "code = main(sys.argv[1:])\n"
         "print('maxrss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)\n"
         "sys.exit(code)\n")


def models(work: Path) -> dict[str, tuple[list[str], int]]:
    """{name: (flags, budget in tokens)}: each budget holds about a quarter of the minibatch."""
    sys.path.insert(0, str(ROOT / "examples"))
    from tiny_models import build_tiny_qwen2  # needs transformers: pip install -e '.[hf]'

    qwen = build_tiny_qwen2(work / "tiny-qwen2", seed=0)
    tiny = ["--prompts-per-step", "32", "--group-size", "8"]
    return {
        "TinyGPT 2x64 (default)": (tiny, 1024),
        "TinyGPT 4x256": (tiny + ["--n-layer", "4", "--n-embd", "256"], 1024),
        "tiny Qwen2, arithmetic prompts": (["--model", str(qwen), "--prompts", str(ROOT / "examples" / "arithmetic.jsonl"),
                                            "--prompts-per-step", "16", "--group-size", "4", "--max-new-tokens", "32",
                                            "--export-hf", "none"], 1024),
    }


def run(flags: list[str], out: Path) -> dict:
    """One trainer process; the medians of its steps after the first, and its peak RSS."""
    cmd = [sys.executable, "-c", CHILD, *flags, "--output-dir", str(out), "--overwrite", "--warmup-steps", "0",
           "--no-plot", "--eval-prompts", "4"]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    step_s = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows, rows[1:])]
    rss = next(int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("maxrss_kib"))
    return {"step_s": statistics.median(step_s), "forward_backward_s": statistics.median(r["time_forward_backward_s"] for r in rows),
            "tokens_per_s": statistics.median(r["tokens_per_second"] for r in rows),
            "padding_fraction": statistics.median(r["padding_fraction"] for r in rows),
            "grad_norm_step2": rows[0]["grad_norm"], "peak_rss_mib": rss / 1024}


def measure(flags: list[str], budget: int, rounds: int, steps: int, work: Path) -> dict:
    names = list(CONFIGS)
    samples = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotated every round
            config = [f.format(budget=budget) for f in CONFIGS[name]]
            samples[name].append(run([*flags, *config, "--steps", str(steps)], work / name.replace(" ", "")))
            print(f"  round {r + 1}/{rounds} {name}: {samples[name][-1]['forward_backward_s']:.3f} s forward+backward",
                  flush=True)
    return {name: {key: statistics.median(s[key] for s in runs) for key in runs[0]} for name, runs in samples.items()}


def table(results: dict) -> list[str]:
    lines = ["| model | split | step (s) | ratio | forward+backward (s) | ratio | tokens/s | padding | peak RSS (MiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for model, configs in results.items():
        base = configs["padded"]
        for name, r in configs.items():
            lines.append(f"| {model} | {name} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f} | "
                         f"{r['forward_backward_s']:.3f} | {r['forward_backward_s'] / base['forward_backward_s']:.2f} | "
                         f"{r['tokens_per_s']:.0f} | {r['padding_fraction']:.1%} | {r['peak_rss_mib']:.0f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks"), help="where packing.md and packing.json go")
    parser.add_argument("--quick", action="store_true", help="1 round of 3 steps: a smoke test, not a measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    rounds, steps = (1, 3) if args.quick else (args.rounds, args.steps)
    load, start = os.getloadavg()[0], time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k, (model, (flags, budget)) in enumerate(models(Path(tmp)).items(), start=1):
            print(f"[{k}/3] {model}: 4 splits x {rounds} rounds of {steps} steps", flush=True)
            results[model] = measure(flags, budget, rounds, steps, Path(tmp))
    wall = time.perf_counter() - start
    machine = (f"{os.cpu_count()} CPUs ({platform.platform()}), torch {torch.__version__}, one process, one thread; "
               f"load average {load:.1f} at the start; {wall:.0f} s in all")
    lines = ["# Padded, packed and token-budget microbatches", "",
             "Regenerated by `python benchmarks/packing.py` (`make bench`); ratios are to the padded split of the",
             f"same model, measured interleaved in one run. {machine}.", "", *table(results), "",
             "The four splits of a model train on the same rollouts to the same gradient (fp32 rounding): "
             "the grad norms of step 2 are " + "; ".join(
                 f"{m}: " + ", ".join(f"{r['grad_norm_step2']:.6f}" for r in c.values()) for m, c in results.items()) + "."]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "packing.md").write_text("\n".join(lines) + "\n")
    (out / "packing.json").write_text(json.dumps({"machine": machine, "results": results}, indent=2) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
