"""Benchmarks: what correct normalization costs, and how fast the pieces run.

    python benchmarks/bench.py               # full run, a few minutes on 2 cores (make bench)
    python benchmarks/bench.py --quick       # a smoke-sized run
    python benchmarks/bench.py --out DIR     # where results.md and results.json go
    python benchmarks/bench.py --readme docs/benchmarks.md  # also rewrite its summary between the bench markers

Every comparison is measured side by side in one run: the modes of a table are interleaved
round-robin (rotating the order each round) on the same ranks, so a noisy neighbour slows them
alike, and each is reported as a median with its spread and as a ratio to the baseline.

1. Optimizer-step time of every denominator against ``local``, on 2 gloo ranks, DDP with
   accumulation; and the collectives gradnorm issues per step beyond DDP's gradient all-reduce.
   The fix's cost resolved (``fixcost.py``): the count all-reduce and the weights timed directly
   (median, p90, % of a step), and the step-time ratio token / local with a bootstrap 95% CI.
2. Rollout generation with the KV cache against without it.
3. How step time grows with response length, model width and world size (1, 2, 4 gloo ranks).
4. How long each notebook takes under nbmake (CI-sized, as the test suite runs it), and how long
   one explorer callback takes (recompute + in-place redraw + PNG), against a 50 ms goal.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from gradnorm.dist import comm, wrap
from gradnorm.core.denominators import mask_from_lengths, parse_denominator
from gradnorm.dist.spawn import count_collectives, spawn_gloo
from gradnorm.core.grpo import grpo_token_losses
from gradnorm.core.sharding import make_plan
from gradnorm.models.tinygpt import GPTConfig, TinyGPT, generate, response_logprobs
from gradnorm.core.accumulate import accumulate_gradients

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fixcost.py beside this script, also in spawned ranks
import fixcost  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

MODES = ["local", "token", "sequence", "group", "256"]


@dataclass(frozen=True)
class StepSetup:
    """One synthetic GRPO minibatch and model size to time optimizer steps on."""

    num_groups: int = 8
    group_size: int = 8
    prompt_len: int = 5
    max_response: int = 32
    n_embd: int = 64
    n_layer: int = 2
    accum_steps: int = 2
    shard: str = "length"
    vocab: int = 32


def _synthetic_batch(setup: StepSetup, seed: int = 0):
    """Tokens (S, P + R), response mask (S, R) with ragged lengths, groups, advantages."""
    g = torch.Generator().manual_seed(seed)
    num_seq = setup.num_groups * setup.group_size
    tokens = torch.randint(setup.vocab, (num_seq, setup.prompt_len + setup.max_response), generator=g)
    lengths = torch.randint(1, setup.max_response + 1, (num_seq,), generator=g)
    mask = mask_from_lengths(lengths, setup.max_response)
    groups = torch.arange(num_seq) // setup.group_size
    advantages = torch.randn(num_seq, generator=g)
    return tokens, mask, groups, advantages


def _time_steps(model, optimizer, setup: StepSetup, modes: list[str], rounds: int, world_size: int, rank: int):
    """Interleaved, rotated rounds of one optimizer step per mode; per-mode seconds and collectives."""
    tokens, mask, groups, advantages = _synthetic_batch(setup)
    plan = make_plan(setup.shard, mask.sum(-1), world_size, setup.accum_steps)[rank]
    module = wrap.unwrap(model)
    with torch.no_grad():
        old_logp, _ = response_logprobs(module, tokens, setup.prompt_len)

    def token_losses(idx):
        logp, entropy = response_logprobs(model, tokens[idx], setup.prompt_len)
        return grpo_token_losses(logp, old_logp[idx], advantages[idx], clip_low=0.2, clip_high=0.28, entropy=entropy)

    times = {m: [] for m in modes}
    collectives = {}
    for r in range(rounds + 1):  # round 0 is the warm-up
        order = modes[r % len(modes):] + modes[: r % len(modes)]
        for mode in order:
            comm.barrier()
            start = time.perf_counter()
            with count_collectives() as calls:
                denominator = parse_denominator(mode)
                counts = comm.global_counts(plan, mask.sum(-1), groups, setup.num_groups, denominator)
                accumulate_gradients(model, plan, mask, groups, counts, denominator, token_losses, world_size)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - start
            if r > 0:
                times[mode].append(elapsed)
            collectives[mode] = calls["n"]
    return times, collectives


def _step_jobs(ctx: comm.DistContext, jobs: list[tuple[str, StepSetup, list[str], int]]) -> dict:
    results = {}
    for name, setup, modes, rounds in jobs:
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=setup.vocab, block_size=setup.prompt_len + setup.max_response,
                           n_layer=setup.n_layer, n_embd=setup.n_embd)
        model = wrap.wrap_policy(TinyGPT(config), "ddp", ctx)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        times, collectives = _time_steps(model, optimizer, setup, modes, rounds, ctx.world_size, ctx.rank)
        results[name] = {"times": times, "collectives": collectives}
    return results


def run_step_jobs(world_size: int, jobs) -> dict:
    """Run timing jobs on ``world_size`` spawned gloo ranks; rank 0's measurements."""
    return spawn_gloo(_step_jobs, world_size, jobs)[0]


def _summary(samples: list[float]) -> dict:
    ordered = sorted(samples)
    q = lambda f: ordered[min(len(ordered) - 1, int(f * len(ordered)))]  # noqa: E731
    return {"median_ms": 1e3 * statistics.median(samples), "p10_ms": 1e3 * q(0.1), "p90_ms": 1e3 * q(0.9),
            "n": len(samples)}


def bench_generation(batch_sizes: list[int], max_new_tokens: int, reps: int) -> list[dict]:
    """Tokens/s of ``generate`` with and without the KV cache, interleaved, one process."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=32, block_size=5 + max_new_tokens)
    model = TinyGPT(config).eval()
    rows = []
    for batch in batch_sizes:
        prompts = torch.randint(3, 32, (batch, 5), generator=torch.Generator().manual_seed(0))
        samples = {True: [], False: []}
        for r in range(reps + 1):
            for use_cache in (True, False) if r % 2 == 0 else (False, True):
                g = torch.Generator().manual_seed(r)
                start = time.perf_counter()
                # eos_id outside the vocabulary: every row runs the full length, same work both ways
                generate(model, prompts, max_new_tokens, eos_id=-1, pad_id=0, generator=g, use_cache=use_cache)
                if r > 0:
                    samples[use_cache].append(time.perf_counter() - start)
        tokens = batch * max_new_tokens
        cached, uncached = statistics.median(samples[True]), statistics.median(samples[False])
        rows.append({"batch": batch, "new_tokens": max_new_tokens,
                     "cache_tok_s": tokens / cached, "no_cache_tok_s": tokens / uncached,
                     "speedup": uncached / cached})
    return rows


def bench_widgets(reps: int) -> list[dict]:
    """Time of one explorer callback (set a control, recompute, move the artists, render, encode the PNG).

    Every explorer is timed twice, interleaved round-robin: as shipped (the in-place canvas of
    ``gradnorm.teach.canvas``: the kept background, the axis cache) and with ``canvas.blit = False``,
    which draws the same in-place figure from scratch on every callback. The controls cycle
    through values that jump across their range, so most callbacks change an axis limit; the
    first round visits every value once and warms the axis cache: its callbacks are reported
    apart (``first_visit_ms``). ``axis_draws`` counts the axis states drawn (cache misses)
    during the timed callbacks, ``full_redraws`` the whole-figure draws.
    """
    from gradnorm.teach import widgets
    from gradnorm.teach.sweeps import gradient_sweep

    torch.set_num_threads(1)
    spreads = [1.0, 4.0, 12.0]
    sweeps = {shard: gradient_sweep(spreads, shard=shard) for shard in ("length", "balanced")}
    views = {
        "01 token imbalance (imbalance slider)": (widgets.token_imbalance_explorer, "imbalance", [2, 6, 3, 8]),
        "01 token imbalance (ranks W slider)": (widgets.token_imbalance_explorer, "world_size", [3, 1, 4, 2]),
        "02 gradient error (mode dropdown)": (lambda: widgets.gradient_explorer(spreads, sweeps=sweeps), "mode",
                                              ["token", "sequence", "local", "constant"]),
        "02 gradient error (sharding dropdown)": (lambda: widgets.gradient_explorer(spreads, sweeps=sweeps),
                                                  "shard", ["balanced", "length"]),
        "04 length bias (wrong length slider)": (widgets.length_bias_explorer, "wrong_len", [20, 50, 33, 60]),
    }
    rows = []
    for name, (build, control, values) in views.items():
        explorers = {blit: build() for blit in (True, False)}
        explorers[False].canvas.blit = False
        samples: dict[bool, list[float]] = {True: [], False: []}
        first_visit: list[float] = []
        counts = {}
        for r in range(reps + len(values)):
            if r == len(values):  # after one warm round through the values
                canvas = explorers[True].canvas
                counts = {"axis_draws": -canvas.axis_draws, "full_redraws": -canvas.full_redraws}
            for blit in (True, False) if r % 2 == 0 else (False, True):
                start = time.perf_counter()
                explorers[blit].controls[control].value = values[r % len(values)]  # the observer redraws
                if r >= len(values):
                    samples[blit].append(time.perf_counter() - start)
                elif blit:
                    first_visit.append(time.perf_counter() - start)
        canvas = explorers[True].canvas
        counts = {"axis_draws": counts["axis_draws"] + canvas.axis_draws,
                  "full_redraws": counts["full_redraws"] + canvas.full_redraws}
        shipped, full = _summary(samples[True]), _summary(samples[False])
        rows.append({"view": name, **shipped, "first_visit_ms": _summary(first_visit)["median_ms"],
                     "full_redraw_ms": full["median_ms"],
                     "speedup": full["median_ms"] / shipped["median_ms"], **counts})
    return rows


def bench_notebooks(root: Path) -> list[dict]:
    """Wall time of each notebook under ``pytest --nbmake`` with CI=1, one at a time."""
    rows = []
    env = {**os.environ, "CI": "1", "OMP_NUM_THREADS": "1"}
    for notebook in sorted((root / "notebooks").glob("*.ipynb")):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pytest", "--nbmake", "-q", "-p", "no:cacheprovider",
                               str(notebook)], cwd=root, env=env, capture_output=True, text=True)
        rows.append({"notebook": notebook.stem, "seconds": time.perf_counter() - start,
                     "passed": proc.returncode == 0})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few rounds: a smoke test of the benchmark")
    parser.add_argument("--out", default="benchmarks", help="folder for results.md and results.json")
    parser.add_argument("--skip-notebooks", action="store_true", help="leave out the nbmake timings")
    parser.add_argument("--rounds", type=int, help="interleaved rounds of the overhead table (default 60, quick 8)")
    parser.add_argument("--readme", help="rewrite the summary between the bench markers of this file (docs/benchmarks.md)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (8 if args.quick else 60)
    base = StepSetup()
    report: dict = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                "torch": torch.__version__, "python": platform.python_version(),
                                "load_average_at_start": os.getloadavg()[0]},
                    "setup": asdict(base), "rounds": rounds, "quick": args.quick}

    print(f"[1/4] normalization overhead on 2 gloo ranks ({rounds} interleaved rounds)...", flush=True)
    sizes = [("len16", StepSetup(max_response=16)), ("len32", base), ("len64", StepSetup(max_response=64)),
             ("len128", StepSetup(max_response=128)), ("width128", StepSetup(n_embd=128)),
             ("width256", StepSetup(n_embd=256))]
    jobs = [("overhead", base, MODES, rounds)] + [(name, s, ["local", "token"], max(3, rounds // 4)) for name, s in sizes]
    steps = run_step_jobs(2, jobs)
    report["overhead"] = {m: _summary(t) for m, t in steps["overhead"]["times"].items()}
    report["collectives"] = steps["overhead"]["collectives"]
    report["scaling_size"] = {name: {m: _summary(t) for m, t in steps[name]["times"].items()} for name, _ in sizes}
    pieces = spawn_gloo(fixcost.time_fix_pieces, 2, base, 50 if args.quick else 500)[0]
    report["fix_cost"] = fixcost.fix_cost_report(pieces, steps["overhead"]["times"])

    print("[2/4] generation with and without the KV cache...", flush=True)
    report["generation"] = bench_generation([16, 64, 256], 32, 3 if args.quick else 10)

    print("[3/4] world size 1, 2, 4 (4 ranks oversubscribe 2 cores)...", flush=True)
    report["scaling_world"] = {}
    for world_size in (1, 2, 4):
        res = run_step_jobs(world_size, [("world", base, ["local", "token"], max(3, rounds // 4))])
        report["scaling_world"][world_size] = {m: _summary(t) for m, t in res["world"]["times"].items()}

    print("[4/4] widget callbacks and notebooks...", flush=True)
    report["widgets"] = bench_widgets(3 if args.quick else 20)
    root = ROOT
    if not args.skip_notebooks and (root / "notebooks").is_dir():
        report["notebooks"] = bench_notebooks(root)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2))
    (out / "results.md").write_text(render_markdown(report))
    print((out / "results.md").read_text())
    if args.readme:
        update_readme(Path(args.readme), readme_summary(report))


README_BEGIN, README_END = "<!-- bench:begin (written by make bench) -->", "<!-- bench:end -->"


def readme_summary(report: dict) -> str:
    """docs/benchmarks.md's paragraph of numbers, copied from the same report that results.md shows."""
    m = report["machine"]
    return (f"From `benchmarks/results.md` as written by the same `make bench` run ({m['cpus']} CPUs, load "
            f"average {m['load_average_at_start']:.1f} at its start{', --quick' if report['quick'] else ''}): "
            + fixcost.summary_sentence(report["fix_cost"]))


def update_readme(path: Path, summary: str) -> None:
    """Replace the text between the file's bench markers with ``summary`` (markers must exist)."""
    text = path.read_text()
    start, end = text.find(README_BEGIN), text.find(README_END)
    if start < 0 or end < start:
        raise SystemExit(f"error: {path} has no {README_BEGIN} ... {README_END} block to rewrite")
    path.write_text(text[: start + len(README_BEGIN)] + "\n" + summary + "\n" + text[end:])


def render_markdown(report: dict) -> str:
    """The tables of ``results.md`` from the JSON report."""
    m = report["machine"]
    s = report["setup"]
    local = report["overhead"]["local"]["median_ms"]
    lines = [
        "# gradnorm benchmark results",
        "",
        f"Generated by `make bench` (`python benchmarks/bench.py{' --quick' if report.get('quick') else ''}`) on "
        f"{m['cpus']} CPUs ({m['platform']}), torch {m['torch']}, load average {m.get('load_average_at_start', 0):.1f}"
        " at the start (other jobs share the machine when it is above 0)."
        + (" A --quick run: smoke-sized, it checks the command; quote only a full run on a quiet machine."
           if report.get("quick") else ""),
        f"Minibatch: {s['num_groups']} groups x {s['group_size']} completions, responses of 1..{s['max_response']}"
        f" tokens, TinyGPT n_embd={s['n_embd']} n_layer={s['n_layer']}, A={s['accum_steps']},"
        f" --shard {s['shard']}, {report['rounds']} interleaved rounds after a warm-up.",
        "",
        "## 1. What correct normalization costs (2 gloo ranks)",
        "",
        "| mode | median step (ms) | p10-p90 (ms) | ratio to local | collectives / step beyond DDP |",
        "|---|---|---|---|---|",
    ]
    for mode, row in report["overhead"].items():
        lines.append(f"| {mode} | {row['median_ms']:.2f} | {row['p10_ms']:.2f}-{row['p90_ms']:.2f} |"
                     f" {row['median_ms'] / local:.3f} | {report['collectives'][mode]} |")
    if "fix_cost" in report:
        lines += ["", "The fix's cost resolved: its two pieces timed directly on 2 gloo ranks (interleaved, "
                  "ranks lined up at a barrier before each all-reduce), beside the whole step.", "",
                  *fixcost.render_fix_cost(report["fix_cost"])]
    lines += ["", "## 2. Rollout generation: KV cache against full recompute (1 process, 1 thread)", "",
              "| batch | new tokens | with cache (tok/s) | without (tok/s) | speed-up |", "|---|---|---|---|---|"]
    for row in report["generation"]:
        lines.append(f"| {row['batch']} | {row['new_tokens']} | {row['cache_tok_s']:.0f} | {row['no_cache_tok_s']:.0f} |"
                     f" {row['speedup']:.2f}x |")
    lines += ["", "## 3. Scaling (token against local, median ms per optimizer step)", "",
              "| configuration | local | token | ratio |", "|---|---|---|---|"]
    for name, row in report["scaling_size"].items():
        lines.append(f"| 2 ranks, {name} | {row['local']['median_ms']:.2f} | {row['token']['median_ms']:.2f} |"
                     f" {row['token']['median_ms'] / row['local']['median_ms']:.3f} |")
    for world_size, row in report["scaling_world"].items():
        lines.append(f"| W={world_size}, same global batch | {row['local']['median_ms']:.2f} |"
                     f" {row['token']['median_ms']:.2f} | {row['token']['median_ms'] / row['local']['median_ms']:.3f} |")
    lines += ["", "## 4. Notebooks and widgets", "",
              "One explorer callback: set the control, recompute from the teaching modules, move the view's"
              " artists in place, render and encode the PNG (goal: a median under 50 ms). As shipped, the"
              " in-place canvas (`gradnorm/teach/canvas.py`) restores a kept background, pastes axis states it has"
              " drawn before and draws only what moved; the baseline draws the same figure from scratch on every"
              " callback. The controls jump across their range; a first round visits each value once (its median"
              " is the first-visit column: new axis states drawn), then the timed rounds count the axis states"
              " drawn and the full redraws.", "",
              "| view | median (ms) | p10-p90 (ms) | first visit (ms) | full redraw every callback (ms) | speed-up |"
              " axis states drawn | full redraws | callbacks |",
              "|---|---|---|---|---|---|---|---|---|"]
    for row in report["widgets"]:
        lines.append(f"| {row['view']} | {row['median_ms']:.1f} | {row['p10_ms']:.1f}-{row['p90_ms']:.1f} |"
                     f" {row['first_visit_ms']:.1f} | {row['full_redraw_ms']:.1f} | {row['speedup']:.1f}x |"
                     f" {row['axis_draws']} | {row['full_redraws']} | {row['n']} |")
    if "notebooks" in report:
        lines += ["", "Each notebook under `pytest --nbmake` with CI=1 (includes starting a kernel):", "",
                  "| notebook | seconds | passed |", "|---|---|---|"]
        for row in report["notebooks"]:
            lines.append(f"| {row['notebook']} | {row['seconds']:.1f} | {row['passed']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
