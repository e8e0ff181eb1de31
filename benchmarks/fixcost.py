"""The price of the fix, piece by piece, with its uncertainty (imported by bench.py).

What ``token`` adds to a step over ``local`` is exactly two things, and both are timed directly
on 2 gloo ranks, many repetitions each, interleaved:

1. the count all-reduce, ``gradnorm.dist.comm.global_counts`` (count the rank's tokens, one
   all-reduce of the int64 vector [N, S, N_g...], read it back); ``local`` skips it entirely;
2. the weights, ``denominators.microbatch_loss`` for each of the rank's A microbatches under
   ``token`` against the same call under ``local`` (both build w and the weighted loss sum).

Beside them, the whole step: the ratio of median step times token / local from the interleaved
rounds of bench.py, with a bootstrap 95% confidence interval that resamples *paired* rounds (each
round times both modes back to back, so a noisy neighbour hits both alike).
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from gradnorm.core.denominators import mask_from_lengths, microbatch_loss, parse_denominator
from gradnorm.dist import comm
from gradnorm.core.sharding import make_plan


def quantile(samples: list[float], q: float) -> float:
    """The q-quantile by the nearest rank (no interpolation), for p10 / p90."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bootstrap_ratio(numerator: list[float], denominator: list[float], resamples: int = 2000,
                    seed: int = 0) -> dict:
    """median(numerator) / median(denominator), and its bootstrap 95% interval over paired rounds.

    ``numerator[r]`` and ``denominator[r]`` were measured in the same round r; a resample draws
    rounds with replacement and keeps each pair together (a percentile bootstrap, fixed seed).
    """
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError("paired samples of equal, non-zero length expected")
    rng = random.Random(seed)
    n = len(numerator)
    ratios = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        ratios.append(statistics.median(numerator[i] for i in idx) / statistics.median(denominator[i] for i in idx))
    return {"ratio": statistics.median(numerator) / statistics.median(denominator),
            "ci_low": quantile(ratios, 0.025), "ci_high": quantile(ratios, 0.975), "rounds": n, "resamples": resamples}


def _micro_summary(seconds: list[float]) -> dict:
    return {"median_us": 1e6 * statistics.median(seconds), "p90_us": 1e6 * quantile(seconds, 0.9), "n": len(seconds)}


def time_fix_pieces(ctx: comm.DistContext, setup, reps: int) -> dict:
    """Per-step seconds of the count all-reduce and of the weights (token and local), ``reps`` times.

    Runs on every rank of a spawned gloo group (``spawn_gloo``); ranks line up at a barrier
    before each timed all-reduce, so it is the collective's own latency, not a wait for a rank
    that is still busy (that wait is the step's, and the phase times of the trainer show it).
    """
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    num_seq = setup.num_groups * setup.group_size
    lengths = torch.randint(1, setup.max_response + 1, (num_seq,), generator=g)
    mask = mask_from_lengths(lengths, setup.max_response)
    groups = torch.arange(num_seq) // setup.group_size
    token_loss = torch.randn(num_seq, setup.max_response, generator=g, requires_grad=True)
    plan = make_plan(setup.shard, lengths, ctx.world_size, setup.accum_steps)[ctx.rank]
    token = parse_denominator("token")
    counts = comm.global_counts(plan, lengths, groups, setup.num_groups, token)

    def weights(denominator, mb_counts):
        for mb in plan:
            microbatch_loss(token_loss[mb], mask[mb], groups[mb], denominator, mb_counts,
                            world_size=ctx.world_size, accum_steps=setup.accum_steps)

    samples = {"counts_allreduce": [], "weights_token": [], "weights_local": []}
    for r in range(reps + 10):  # the first 10 are warm-up
        comm.barrier()
        start = time.perf_counter()
        comm.global_counts(plan, lengths, groups, setup.num_groups, token)
        allreduce = time.perf_counter() - start
        timed = {}
        for name, denominator, mb_counts in (("weights_token", token, counts), ("weights_local", "local", None))[:: 1 - 2 * (r % 2)]:
            start = time.perf_counter()
            weights(denominator, mb_counts)
            timed[name] = time.perf_counter() - start
        if r >= 10:
            samples["counts_allreduce"].append(allreduce)
            for name, seconds in timed.items():
                samples[name].append(seconds)
    overhead = [t - l for t, l in zip(samples["weights_token"], samples["weights_local"])]
    return {**{name: _micro_summary(s) for name, s in samples.items()},
            "weights_overhead": {"median_us": 1e6 * statistics.median(overhead),
                                 "p90_us": 1e6 * quantile(overhead, 0.9), "n": len(overhead)}}


def fix_cost_report(pieces: dict, step_times: dict[str, list[float]]) -> dict:
    """The pieces as % of a median ``local`` step, and the step-time ratio token / local with its CI."""
    local_us = 1e6 * statistics.median(step_times["local"])
    ratio = bootstrap_ratio(step_times["token"], step_times["local"])
    pct = {name: {**row, "pct_of_step": 100 * row["median_us"] / local_us} for name, row in pieces.items()}
    total = pieces["counts_allreduce"]["median_us"] + pieces["weights_overhead"]["median_us"]
    return {"pieces": pct, "local_step_us": local_us, "fix_us": total, "fix_pct_of_step": 100 * total / local_us,
            "step_ratio": ratio}


def render_fix_cost(cost: dict) -> list[str]:
    """Markdown lines of the fix's cost, for results.md (and the summary that goes into docs/benchmarks.md)."""
    rows = [("count all-reduce (`global_counts`, token)", "counts_allreduce"),
            ("weights + weighted loss, token (A microbatches)", "weights_token"),
            ("weights + weighted loss, local (A microbatches)", "weights_local"),
            ("weights: token minus local, paired", "weights_overhead")]
    lines = ["| piece, per optimizer step on rank 0 | median (us) | p90 (us) | median, % of a local step |",
             "|---|---|---|---|"]
    for label, key in rows:
        row = cost["pieces"][key]
        lines.append(f"| {label} | {row['median_us']:.1f} | {row['p90_us']:.1f} | {row['pct_of_step']:.3f}% |")
    lines += ["", summary_sentence(cost)]
    return lines


def summary_sentence(cost: dict) -> str:
    """One sentence with the fix's cost and its uncertainty (results.md and docs/benchmarks.md say the same)."""
    r = cost["step_ratio"]
    pieces = cost["pieces"]
    return (f"The fix costs {cost['fix_us']:.0f} us per step measured directly (the count all-reduce, median "
            f"{pieces['counts_allreduce']['median_us']:.0f} us, p90 {pieces['counts_allreduce']['p90_us']:.0f} us; "
            f"the weights, {pieces['weights_overhead']['median_us']:+.0f} us against local), "
            f"{cost['fix_pct_of_step']:.2f}% of a median local step of {cost['local_step_us'] / 1e3:.1f} ms. "
            f"The whole step, token / local: {r['ratio']:.3f} (bootstrap 95% CI {r['ci_low']:.3f} to "
            f"{r['ci_high']:.3f}, {r['rounds']} paired rounds): the interval, not the point, is the "
            "measurement of the step; where it contains 1, the step time cannot tell the two modes apart.")
