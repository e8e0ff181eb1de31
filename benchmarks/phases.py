"""Where a step's time goes, per rank, at W = 1 and W = 2: a cost that grows with W shows as a ratio.

    python benchmarks/phases.py              # about 5 minutes on 2 cores (make bench runs it)
    python benchmarks/phases.py --quick      # a smoke-sized run
    python benchmarks/phases.py --out DIR    # where phases.md and phases.json go

The real trainer (``gradnorm/train.py``, default model and batch: 32 prompts x 8 completions, no
warm-up) under torchrun with 1 and with 2 gloo ranks, in two configurations:

- ``default``: fully on-policy, beta = 0 (nothing to score);
- ``reuse + KL``: ``--beta 0.04 --minibatches-per-rollout 2``: every rollout feeds 2 updates, so
  the sampling policy's log-probs are scored once per rollout, and the reference's too.

Every step logs its phase times (``gradnorm.trainer.logs.phases.PhaseTimer``): rank 0's own
(``time_<phase>_s``) and, for the phases whose work can differ between ranks, the slowest rank's
(``time_<phase>_max_s``). Per phase the table gives seconds per optimizer step (the phase's total
over the steps after the first rollout, divided by their number), for rank 0 and the slowest rank,
and the ratio of W = 2 to W = 1. A phase whose work is split over the ranks should come out near
0.5 (on 2 cores, where each rank has a core); one that every rank does in full stays near 1.

A third column is the control for the machine itself: two W = 1 launches at once, each in its own
process group, sharing the cores as two ranks do but with no collective between them. A phase's
W = 2 time over that twin's time is what splitting the work saved, with the cost of sharing the
machine taken out.

Launches alternate between the configurations, round by round in rotated order, so that a noisy
neighbour slows them alike; the medians over rounds are reported with the load.

Then the scoring A/B, paired in one run: on spawned gloo ranks, the default model and one rollout
batch of the reuse + KL configuration (64 prompts x 8), each rank times scoring the sampling
policy's and the reference's log-probs three ways, in rotated order, 20 rounds: the whole batch
on every rank; each rank its training rows (``scoring.shares``); and what the trainer does
(``scoring.score``), 1/W of the rows balanced by cost, then one all-to-all that gives each rank the
rows it trains on. At W = 1 all three score the whole batch. Each is timed in wall time and in the
scoring thread's CPU time, which leaves out the time a rank waits for its peer.
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
sys.path.insert(0, str(ROOT))

from gradnorm.teach.launch import torchrun_command  # noqa: E402
from gradnorm.trainer.logs.phases import MAX_PHASES, PHASES  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
CONFIGS = {"default": [], "reuse + KL": ["--beta", "0.04", "--minibatches-per-rollout", "2"]}
SHOWN = ("rollout", "scoring", "forward_backward", "optimizer")  # the phases with work in them


def _command(world_size: int, flags: list[str], steps: int, out: Path) -> list[str]:
    return torchrun_command(world_size, *flags, "--steps", str(steps), "--warmup-steps", "0", "--eval-prompts", "8",
                            "--save-every", "0", "--no-plot", "--device", "cpu", "--output-dir", str(out))


def _phases(out: Path) -> dict[str, dict[str, float]]:
    """{phase: {"rank0": s/step, "max": s/step}} of a finished run, after its first rollout."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = rows[2:]  # the first rollout (2 steps under reuse) warms caches and allocators up
    found = {}
    for phase in PHASES:
        rank0 = sum(r[f"time_{phase}_s"] for r in rows) / len(rows)
        slowest = sum(r[f"time_{phase}_max_s"] for r in rows) / len(rows) if phase in MAX_PHASES else rank0
        found[phase] = {"rank0": rank0, "max": slowest}
    # the mean wall time per step over the same steps: rank 0's phases add up to its step (under
    # reuse a median would jump between the steps with a rollout and the steps without one)
    found["step"] = {"rank0": sum(found[phase]["rank0"] for phase in PHASES)}
    found["step"]["max"] = found["step"]["rank0"]
    return found


def launch(world_size: int, flags: list[str], steps: int, out: Path, twins: int = 1) -> dict[str, dict[str, float]]:
    """``twins`` torchrun launches of the trainer at once (each in its own directory); the mean of their phases.

    Two W = 1 twins side by side are the control for W = 2: one rank each, sharing the machine as
    two ranks do, with no collective between them.
    """
    outs = [out.with_name(f"{out.name}-{i}") for i in range(twins)]
    procs = [subprocess.Popen(_command(world_size, flags, steps, o), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for o in outs]
    for proc in procs:
        stdout, stderr = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(proc.args)} failed:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    runs = [_phases(o) for o in outs]
    return {phase: {k: statistics.mean(run[phase][k] for run in runs) for k in ("rank0", "max")} for phase in runs[0]}


CELLS = {1: (1, 1), "twin": (1, 2), 2: (2, 1)}
"""Column -> (world size, launches at once): one rank alone, one rank beside a twin, two ranks."""


def measure(steps: int, rounds: int) -> dict:
    """{config: {column: {phase: {rank0, max}}}}: medians over ``rounds`` rotated rounds of launches."""
    cells = [(name, col) for name in CONFIGS for col in CELLS]
    runs = {cell: [] for cell in cells}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for name, col in cells[r % len(cells):] + cells[: r % len(cells)]:
                out = Path(tmp) / f"{r}-{col}-{name.replace(' ', '').replace('+', '')}"
                w, twins = CELLS[col]
                runs[name, col].append(launch(w, CONFIGS[name], steps, out, twins))
                print(f"round {r + 1}/{rounds}: {name}, {col} done", file=sys.stderr, flush=True)
    return {name: {col: {phase: {k: statistics.median(run[phase][k] for run in runs[name, col]) for k in ("rank0", "max")}
                         for phase in runs[name, col][0]}
                   for col in CELLS}
            for name in CONFIGS}


def scoring_worker(ctx, rounds: int, shard: str) -> dict:
    """On each rank: seconds to score the old and the reference log-probs, each way of ``VARIANTS``."""
    import copy

    from gradnorm.dist import comm
    from gradnorm.trainer import scoring
    from gradnorm.trainer.config import parse_config
    from gradnorm.trainer.policy import build_policy
    from gradnorm.trainer.rollout import generate_rollout

    cfg = parse_config([*CONFIGS["reuse + KL"], "--shard", shard, "--device", "cpu"], ctx.world_size)
    task, policy = build_policy(cfg, ctx.device)
    ref = copy.deepcopy(policy.model).eval()
    share = dict(rank=ctx.rank, world_size=ctx.world_size) if ctx.world_size > 1 else {}
    with torch.no_grad():
        rollout = generate_rollout(policy, task, num_prompts=cfg.prompts_per_step * cfg.minibatches_per_rollout,
                                   group_size=cfg.group_size, seed=0, step=1, temperature=1.0, **share)
    shares = scoring.shares(rollout, cfg, ctx.world_size)
    modules = [policy.model, ref]

    def own_rows():  # each rank its training rows, no exchange (the trainer before step.scoring_split)
        return [scoring.score_rows(policy, module, rollout, shares[ctx.rank]) for module in modules]

    variants = {"balanced": lambda: scoring.score(policy, modules, rollout, shares, ctx.rank), "own": own_rows,
                "whole": lambda: scoring.score(policy, modules, rollout)}
    times, cpu = {name: [] for name in variants}, {name: [] for name in variants}
    with torch.no_grad():
        for r in range(rounds + 1):
            for name in (list(variants)[r % 3:] + list(variants)[: r % 3]):  # rotated: each goes first in turn
                comm.barrier()  # the ranks start together, as they leave the rollout's all_gather
                t0, c0 = time.perf_counter(), time.thread_time()
                variants[name]()
                if r:  # round 0 warms up
                    times[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.thread_time() - c0)  # this rank's own work, without waiting
    rows = {"balanced": len(scoring.scoring_split(rollout.lengths, ctx.world_size)[ctx.rank]),
            "own": len(shares[ctx.rank]), "whole": len(rollout.rewards)}
    return {"times": times, "cpu": cpu, "rows": rows}


def scoring_ab(rounds: int) -> dict:
    """{cell: {variant: {median_s, cpu_s, rows}}} for W = 1 and, under each of ``AB_SHARDS``, W = 2:
    per round the slowest rank's time (the phase ends when the last rank is done), the median over
    rounds; ``cpu_s`` the same of the ranks' CPU time (the scoring thread's: its own work, without
    the time it waits for its peer); ``rows`` the most any rank scored."""
    from gradnorm.dist.spawn import spawn_gloo

    found = {}
    for cell, (world_size, shard) in {"1": (1, "interleave"), **{f"2 {s}": (2, s) for s in AB_SHARDS}}.items():
        ranks = spawn_gloo(scoring_worker, world_size, rounds, shard)
        found[cell] = {name: {"median_s": statistics.median(map(max, zip(*(r["times"][name] for r in ranks)))),
                              "cpu_s": statistics.median(map(max, zip(*(r["cpu"][name] for r in ranks)))),
                              "rows": max(r["rows"][name] for r in ranks)} for name in VARIANTS}
    return found


AB_SHARDS = ("interleave", "length")
"""The trainer's default sharding, and ``--shard length`` (rank 0 trains on the shortest rows)."""


VARIANTS = {"whole": "every rank, the whole batch",
            "own": "each rank its training rows (`scoring.shares`), no exchange",
            "balanced": "1/W of the rows balanced by cost (`step.scoring_split`), then one all-to-all: the trainer"}
"""The scoring A/B's variants, in the order the table gives them."""


def render(found: dict, args, load: tuple[float, float], seconds: float) -> str:
    lines = [
        "# Phase times per rank at W = 1 and W = 2",
        "",
        f"Generated by `python benchmarks/phases.py` in {seconds:.0f} s on {os.cpu_count()} CPUs ({platform.platform()}), "
        f"torch {torch.__version__}, one thread per rank. Load average {load[0]:.1f} before and {load[1]:.1f} after: "
        "the machine is shared, so the ratios, measured side by side, are worth more than the times.",
        "",
        f"The trainer with its default model and batch (32 prompts x 8 completions, no warm-up), {args.steps} steps, "
        f"medians of {args.rounds} launches per cell; seconds per optimizer step after the first rollout. "
        "`rank 0` is its own time; `slowest` the slowest rank's, for the phases whose work can differ between ranks.",
        "",
        "| configuration | phase | W=1 (s/step) | W=1 beside a twin | W=2 rank 0 | W=2 slowest "
        "| W=2 / W=1 (slowest) | W=2 / twin |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, by_w in found.items():
        for phase in (*SHOWN, "step"):
            one, twin, two = by_w[1][phase]["max"], by_w["twin"][phase]["max"], by_w[2][phase]
            if one < 1e-5 and two["max"] < 1e-5:
                continue  # nothing happens in this phase here (scoring without reuse or KL)
            ratio = two["max"] / one if one > 0 else float("nan")
            shared = two["max"] / twin if twin > 0 else float("nan")
            label = "whole step" if phase == "step" else phase
            lines.append(f"| {name} | {label} | {one:.4f} | {twin:.4f} | {two['rank0']:.4f} | {two['max']:.4f} "
                         f"| {ratio:.2f}x | {shared:.2f}x |")
    score = found["reuse + KL"]
    ratio = score[2]["scoring"]["max"] / score[1]["scoring"]["max"]
    control = score[2]["scoring"]["max"] / score["twin"]["scoring"]["max"]
    neighbour = score["twin"]["scoring"]["max"] / score[1]["scoring"]["max"]
    ab = args.ab
    one, one_cpu = ab["1"]["whole"]["median_s"], ab["1"]["whole"]["cpu_s"]
    lines += [
        "",
        f"In the trainer, scoring with reuse and KL (the sampling policy's and the reference's log-probs, once per "
        f"rollout) takes the slowest rank {ratio:.2f}x at W = 2 of what one rank takes at W = 1. "
        f"The control, two W = 1 runs at once (`W=1 beside a twin`: each alone in its process group, sharing "
        f"the 2 cores as two ranks do), says what sharing the machine costs by itself: one rank's scoring "
        f"takes {neighbour:.2f}x as long beside a twin as alone. Against it, W = 2 takes {control:.2f}x. "
        f"Each W = 2 rank scores half the rows; the A/B below measures what the same work costs when both ranks "
        f"run at once (`every rank, the whole batch`: "
        f"{ab['2 interleave']['whole']['median_s'] / ab['1']['whole']['median_s']:.2f}x of one rank alone, "
        f"{ab['2 interleave']['whole']['cpu_s'] / ab['1']['whole']['cpu_s']:.2f}x in CPU time), the floor "
        f"that halved work starts from on this machine.",
        "",
        f"## Scoring A/B: what each rank scores ({args.ab_rounds} rotated rounds, one run)",
        "",
        "Per round the slowest rank's time, the ranks starting together; the median over rounds. At W = 1 "
        f"every way scores the whole batch ({ab['1']['whole']['rows']} rows); at W = 2 under the default "
        "sharding and under `--shard length`, where rank 0 trains on the shortest rows. `CPU` is the same "
        "statistic of the scoring thread's CPU time: a rank's own work, without the time it waits for its peer.",
        "",
        "| what each rank scores | rows per rank | interleave (ms) | / W=1 | CPU (ms) | / W=1 "
        "| length (ms) | / W=1 | CPU (ms) | / W=1 |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| W = 1: the whole batch | {ab['1']['whole']['rows']} | {1e3 * one:.1f} | 1.00x "
        f"| {1e3 * one_cpu:.1f} | 1.00x | | | | |",
        *(f"| W = 2: {words} | {ab['2 interleave'][name]['rows']} | "
          + " | ".join(f"{1e3 * ab[f'2 {s}'][name]['median_s']:.1f} | {ab[f'2 {s}'][name]['median_s'] / one:.2f}x | "
                       f"{1e3 * ab[f'2 {s}'][name]['cpu_s']:.1f} | {ab[f'2 {s}'][name]['cpu_s'] / one_cpu:.2f}x"
                       for s in AB_SHARDS) + " |" for name, words in VARIANTS.items()),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    parser.add_argument("--quick", action="store_true", help="a smoke-sized run")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args(argv)
    args.steps = args.steps or (6 if args.quick else 20)
    args.rounds = args.rounds or (1 if args.quick else 3)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    found = measure(args.steps, args.rounds)
    args.ab_rounds = 4 if args.quick else 20
    args.ab = scoring_ab(args.ab_rounds)
    seconds, load1 = time.perf_counter() - t0, os.getloadavg()[0]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "phases.json").write_text(json.dumps({"steps": args.steps, "rounds": args.rounds, "load": [load0, load1],
                                                      "seconds": seconds, "found": found, "scoring_ab": args.ab},
                                                     indent=1) + "\n")
    text = render(found, args, (load0, load1), seconds)
    (args.out / "phases.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
