"""Rollout generation against the world size: --rollouts sharded (each rank samples S / W sequences)
against replicated (each rank samples all S).

    python benchmarks/rollouts.py              # a few minutes on 2 cores (make bench runs it)
    python benchmarks/rollouts.py --quick      # a smoke-sized run
    python benchmarks/rollouts.py --out DIR    # where rollouts.md goes
    python benchmarks/rollouts.py --drift      # and 3 default trainings (how long W = 1 and 2 agree)

1. Rollout seconds per step. One torchrun launch of 2 gloo ranks (this script's ``--worker`` mode)
   builds the trainer's policy (``policy.build_policy``: an untrained TinyGPT, the default 2x64 and a
   wider 4x256, on the built-in task, 32 prompts x 8 completions, up to 20 new tokens) and times
   ``rollout.generate_rollout`` in four configurations, interleaved round-robin with the order
   rotated every round so that a noisy neighbour slows them alike: W = 1 under each mode (rank 0
   samples alone while rank 1 waits at a barrier; the two modes are the same code at W = 1, so
   their ratio shows the noise), and W = 2 sharded and replicated. Every round samples a new step
   (new prompts and noise); all four configurations of a round must give the same batch (digest).
2. Whole optimizer steps: torchrun launches of ``gradnorm/train.py`` (no warm-up) at W = 1 and 2
   under each mode, two rounds in rotated order; median step time (from ``elapsed_s``) and
   response tokens per second of the global batch over the steps after the first.

3. With --drift: the default training (300 steps, seed 0) at W = 1 and at W = 2 under each mode,
   and the first step whose rollout_digest differs between them.

``gpu_check.py`` reuses ``measure`` (the worker) on GPUs, for rollout tokens/s per GPU.
"""

from __future__ import annotations

import argparse
import contextlib
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

from gradnorm.teach.launch import torchrun_command

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# The default policy, where a decode step's Python overhead is a large share, and a wider one,
# where the matmuls (which sharding divides) dominate, as they do for real models.
MODELS = {"2x64 (default)": [], "4x256": ["--n-layer", "4", "--n-embd", "256"]}


def _torchrun(nproc: int, script: str, *args: str) -> list[str]:
    return torchrun_command(nproc, *args, script=script)


# ------------------------------------------------------------------ the worker (one torchrun launch)


def worker(argv: list[str]) -> int:
    """Under torchrun: time generate_rollout per configuration; rank 0 writes the samples to --json.

    Flags this script does not know go to the trainer's parser, so any policy the trainer can build
    (``--model``, ``--device``, ``--precision``, the batch) can be timed.
    """
    from gradnorm.dist import comm
    from gradnorm.trainer.rollout import generate_rollout
    from gradnorm.trainer.policy import build_policy
    from gradnorm.trainer.config import parse_config

    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    parser.add_argument("--rounds", type=int, default=20)
    args, trainer_flags = parser.parse_known_args(argv)
    cfg = parse_config(trainer_flags, int(os.environ.get("WORLD_SIZE", 1)))
    torch.set_num_threads(cfg.cpu_threads)
    ctx = comm.setup(backend=None if cfg.backend == "auto" else cfg.backend,
                     device=None if cfg.device == "auto" else cfg.device, timeout_s=cfg.timeout_s)
    try:
        task, policy = build_policy(cfg, ctx.device)

        amp = cfg.autocast_dtype(ctx.device.type)
        W = ctx.world_size
        configs = [(1, "replicated"), (1, "sharded")] + ([(W, "replicated"), (W, "sharded")] if W > 1 else [])
        samples = {f"W={w} {mode}": {"seconds": [], "tokens": []} for w, mode in configs}
        same_batch = True

        def sync():
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            comm.barrier()

        for r in range(args.rounds + 1):  # round 0 is the warm-up
            digests = set()
            for w, mode in configs[r % len(configs):] + configs[: r % len(configs)]:
                sharded = w > 1 and mode == "sharded"
                share = dict(rank=ctx.rank, world_size=W) if sharded else dict(rank=0, world_size=1)
                sync()
                start = time.perf_counter()
                rollout = None
                if w > 1 or ctx.rank == 0:  # W = 1: rank 0 samples alone, the others wait in sync()
                    autocast = torch.autocast(ctx.device.type, dtype=amp) if amp else contextlib.nullcontext()
                    with autocast:
                        rollout = generate_rollout(policy, task, num_prompts=cfg.prompts_per_step,
                                                   group_size=cfg.group_size, seed=cfg.seed, step=r + 1,
                                                   temperature=cfg.temperature, **share)
                sync()
                if r > 0 and ctx.rank == 0:
                    samples[f"W={w} {mode}"]["seconds"].append(time.perf_counter() - start)
                    samples[f"W={w} {mode}"]["tokens"].append(int(rollout.mask.sum()))
                if rollout is not None:
                    digests.add(rollout.digest())
            same_batch &= len(digests) == 1
        if ctx.is_main:
            Path(args.json).write_text(json.dumps({"world_size": W, "same_batch": same_batch, "samples": samples,
                                                   "sequences": cfg.sequences_per_step}))
    finally:
        comm.teardown()
    return 0


def measure(nproc: int, flags: list[str], rounds: int) -> dict:
    """One torchrun launch of the worker on ``nproc`` ranks; {config: {median_s, p10_s, p90_s, tokens_per_s}}."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rollouts.json"
        cmd = _torchrun(nproc, str(Path(__file__).resolve()), "--worker", "--json", str(out),
                        "--rounds", str(rounds), *flags)
        proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        raw = json.loads(out.read_text())
    table = {}
    for name, s in raw["samples"].items():
        ordered = sorted(s["seconds"])
        median = statistics.median(ordered)
        table[name] = {"median_s": median, "p10_s": ordered[int(0.1 * len(ordered))],
                       "p90_s": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
                       "tokens_per_s": statistics.median(s["tokens"]) / median}
    return {"world_size": raw["world_size"], "same_batch": raw["same_batch"], "sequences": raw["sequences"],
            "configs": table}


# ------------------------------------------------------------------ whole optimizer steps


def train_steps(nproc: int, mode: str, steps: int, out: Path) -> dict:
    """One torchrun launch of the trainer; median seconds per step and tokens/s after the first step."""
    cmd = _torchrun(nproc, "gradnorm/train.py", "--rollouts", mode, "--steps", str(steps), "--warmup-steps", "0",
                    "--eval-prompts", "8", "--save-every", "0", "--no-plot", "--device", "cpu", "--output-dir", str(out))
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step_s = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows, rows[1:])]
    tokens_per_s = statistics.median(r["tokens_per_second"] for r in rows[1:])
    return {"step_s": statistics.median(step_s), "tokens_per_s": tokens_per_s}


def whole_steps(steps: int, rounds: int) -> dict:
    """{(W, mode): medians over rounds of train_steps}, launches rotated round by round."""
    configs = [(1, "replicated"), (1, "sharded"), (2, "replicated"), (2, "sharded")]
    found = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for w, mode in configs[r % 4:] + configs[: r % 4]:
                found[w, mode].append(train_steps(w, mode, steps, Path(tmp) / f"{w}-{mode}-{r}"))
    return {c: {k: statistics.median(run[k] for run in runs) for k in ("step_s", "tokens_per_s")}
            for c, runs in found.items()}


# ------------------------------------------------------------------ how long W = 1 and W = 2 stay bit-identical


def drift(steps: int) -> dict:
    """Default trainings (seed 0) at W = 1 and at W = 2 under each mode; where their rollouts part.

    Returns {name: {"first_different_step": step or None, "reward_last10": mean}} for W = 2
    sharded and replicated against W = 1, and sharded against replicated at W = 2.
    """
    runs = {"W=1": (1, "sharded"), "W=2 sharded": (2, "sharded"), "W=2 replicated": (2, "replicated")}
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (nproc, mode) in runs.items():
            out = Path(tmp) / name.replace(" ", "-").replace("=", "")
            cmd = _torchrun(nproc, "gradnorm/train.py", "--rollouts", mode, "--steps", str(steps), "--save-every", "0",
                            "--no-plot", "--device", "cpu", "--output-dir", str(out))
            subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, check=True)
            rows[name] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    def first_difference(a, b):
        return next((x["step"] for x, y in zip(rows[a], rows[b]) if x["rollout_digest"] != y["rollout_digest"]), None)

    return {"steps": steps,
            "pairs": {f"{b} vs {a}": first_difference(a, b) for a, b in
                      [("W=1", "W=2 sharded"), ("W=1", "W=2 replicated"), ("W=2 replicated", "W=2 sharded")]},
            "reward_last10": {name: statistics.mean(r["reward_mean"] for r in rows[name][-10:]) for name in rows}}


# ------------------------------------------------------------------ the report


def render_drift(found: dict) -> list[str]:
    lines = ["", f"## 3. How long W = 1 and W = 2 stay bit-identical ({found['steps']} default steps, seed 0)", "",
             "| runs compared | first step whose rollout differs |", "|---|---|"]
    for pair, step in found["pairs"].items():
        lines.append(f"| {pair} | {'none' if step is None else step} |")
    rewards = ", ".join(f"{name} {value:.3f}" for name, value in found["reward_last10"].items())
    return lines + ["", f"Mean reward of the last 10 steps: {rewards}."]


def render(rollouts: dict[str, dict], steps: dict, args, load: tuple[float, float], seconds: float) -> str:
    lines = [
        "# Sharded against replicated rollouts",
        "",
        f"Generated by `python benchmarks/rollouts.py{' --quick' * args.quick}{' --drift' * args.drift}` in {seconds:.0f} s on "
        f"{os.cpu_count()} CPUs ({platform.platform()}), torch {torch.__version__}, one thread per rank. "
        f"Load average {load[0]:.1f} before and {load[1]:.1f} after: the machine is shared, so a ratio "
        "is worth more than an absolute time.",
        "",
        f"## 1. Rollout seconds per step ({args.rounds} interleaved rounds; untrained TinyGPT, "
        f"{next(iter(rollouts.values()))['sequences']} sequences of up to 20 new tokens)",
        "",
        "| model | configuration | median (s) | p10-p90 (s) | ratio to W=1 | response tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    notes = []
    for model, result in rollouts.items():
        cfg = result["configs"]
        for name, row in cfg.items():
            base = cfg[f"W=1 {name.split()[1]}"]["median_s"]
            lines.append(f"| {model} | {name} | {row['median_s']:.3f} | {row['p10_s']:.3f}-{row['p90_s']:.3f} | "
                         f"{row['median_s'] / base:.2f}x | {row['tokens_per_s']:,.0f} |")
        noise = cfg["W=1 sharded"]["median_s"] / cfg["W=1 replicated"]["median_s"]
        notes.append(f"{model}: {noise:.2f}, same batch in every round: {'yes' if result['same_batch'] else 'NO'}")
    lines += ["", "At W=1 the two modes run the same code, so the ratio of their medians is the noise of the run; "
              "every round's configurations must sample the same batch (equal rollout digests). "
              + "; ".join(notes) + ".", "",
              f"## 2. Whole optimizer steps (gradnorm/train.py, default batch, no warm-up, {args.steps} steps, "
              f"median of {args.train_rounds} launches each)", "",
              "| W | --rollouts | median step (s) | ratio to W=1 | response tokens/s |", "|---|---|---|---|---|"]
    for (w, mode), row in steps.items():
        lines.append(f"| {w} | {mode} | {row['step_s']:.3f} | {row['step_s'] / steps[1, mode]['step_s']:.2f}x | "
                     f"{row['tokens_per_s']:,.0f} |")
    if args.drift:
        lines += render_drift(args.drift_found)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds: a smoke test of the benchmark")
    parser.add_argument("--out", default="benchmarks", help="folder for rollouts.md")
    parser.add_argument("--drift", action="store_true", help="also train W = 1 and 2 to the end (3 more runs) "
                        "and report the first step whose rollouts differ")
    args = parser.parse_args(argv)
    args.rounds, args.steps, args.train_rounds = (3, 4, 1) if args.quick else (20, 30, 2)
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    rollouts, parts = {}, 3 if args.drift else 2
    for model, flags in MODELS.items():
        print(f"[1/{parts}] rollout time of {model}, 4 configurations on 2 gloo ranks ({args.rounds} rounds)...", flush=True)
        rollouts[model] = measure(2, ["--device", "cpu", *flags], args.rounds)
    print(f"[2/{parts}] whole steps, W = 1 and 2 x both modes ({args.train_rounds} rounds of 4 launches)...", flush=True)
    steps = whole_steps(args.steps, args.train_rounds)
    if args.drift:
        print("[3/3] drift: the default training at W = 1, and at W = 2 under each mode...", flush=True)
        args.drift_found = drift(4 if args.quick else 300)
    report = render(rollouts, steps, args, (load_before, os.getloadavg()[0]), time.perf_counter() - start)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rollouts.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
