"""A controlled comparison of the loss denominators: does the fix change what GRPO learns?

    make study                                   # the committed results (under an hour on 2 cores)
    python benchmarks/study.py --out benchmarks  # the same
    python benchmarks/study.py --pilot           # 2 cells x 1 seed, for sizing; writes nothing

What it runs. The real trainer, ``gradnorm/train.py``, as one subprocess per run, ``--jobs`` at a
time (one per core), on two built-in tasks: ``repeat`` (n uniform in 1..16) and ``bimodal`` (n in
1..4 or 13..16, half and half; its hard cases need long responses). Each cell is a denominator
(``local``, ``token``, ``sequence``, the constant C = S x max-new-tokens of Dr GRPO, ``group``)
under a sharding, with ``--seeds`` seeds; runs of one seed share the warm-up policy and their first
rollout batch, so cells are compared seed by seed.

1. Shardings. ``length`` sorts the minibatch by response length before cutting it (the short
   responses share microbatches, so do the long ones): the imbalance that makes ``local`` differ
   most. ``balanced`` packs microbatches to near-equal token counts, where ``local`` is close to
   ``token``. The invariant denominators give the same update under every sharding (to fp32
   rounding: the project's equivalence tests), so they run under ``length`` only; ``local`` runs
   under both.
2. One process stands for W = 2 ranks x A = 2 microbatches. Under ``length`` and ``balanced`` the
   plan of (W = 1, A = 4) cuts the same four sorted row sets as (W = 2, A = 2), so every token gets
   the same weight in every mode. ``check_single_process`` proves it on the lengths of every run's
   final rollouts (``gradnorm.core.simulate.effective_weights``, exact comparison) and the study
   stops if it fails; then one single-process run per core is four times the throughput of a
   2-rank torchrun pair on the same two cores.
3. Clipping. The trainer clips the gradient norm to 1.0; most steps exceed it. Two extra cells on
   ``bimodal`` (``local`` and ``token`` under ``length``, ``--max-grad-norm 1e6``) show what
   clipping hides.
4. Measures per run: steps until the trailing 10-step mean rollout reward reaches the task's
   threshold (chosen from the pilot before the full run; a run that never reaches it counts as its
   last step and is reported as censored), the final reward (mean of the last 10 steps' rollouts),
   the final policy's reward on a fixed eval set (every letter x every count of the task, 4 samples
   each at temperature 1) split by the target length n, the response-length drift (last 10 steps
   minus first 10), the fraction of steps whose gradient norm exceeded the clip, and the logged
   per-step skew (the largest and smallest token weight relative to the token mean, ``skew_max`` /
   ``skew_min``). Per cell: the mean over seeds and a 95% percentile bootstrap interval (2000
   resamples of seeds, seeded); between cells: the paired difference seed by seed, with its interval.

Outputs: ``study.md`` (tables, the prediction written before the full run and its outcome),
``study.json`` (every run's curves and numbers; notebook 03 draws from it) and ``study.png``.
Progress: one line per finished run on stderr (cell, seed, seconds, eta).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gradnorm.core.denominators import parse_denominator  # noqa: E402
from gradnorm.core.sharding import make_plan  # noqa: E402
from gradnorm.core.simulate import effective_weights  # noqa: E402
from gradnorm.models.tinygpt import GPTConfig, TinyGPT, generate  # noqa: E402
from gradnorm.tasks import builtin_task  # noqa: E402
from gradnorm.teach.study import Interval, bootstrap_ci, paired_difference, steps_to_threshold  # noqa: E402
from gradnorm.trainer.checkpoint.store import latest_checkpoint, read_tensors  # noqa: E402
from gradnorm.trainer.logs.curves import moving_average, read_metrics  # noqa: E402
from gradnorm.trainer.rollout import response_mask  # noqa: E402

TRAIN = ROOT / "gradnorm" / "train.py"
TASKS = ("bimodal", "repeat")
MODES = ("local", "token", "sequence", "constant", "group")
NO_CLIP = 1e6  # --max-grad-norm this large never clips: the logged norms stay below 100
WINDOW = 10  # steps of the trailing mean (threshold, final reward, drift)
EVAL_SAMPLES = 4  # eval samples per (letter, n)
BUCKETS = {"repeat": {"1-4": (1, 4), "5-8": (5, 8), "9-12": (9, 12), "13-16": (13, 16)},
           "bimodal": {"1-4": (1, 4), "13-16": (13, 16)}}

# Written before the full run (its own commit), and kept verbatim.
PREDICTION = """\
Written after a one-seed pilot (`--pilot`: `local` and `token` under `length` on both tasks, used
to size the runs and pick the thresholds) and before the full run.

Under `--shard length` the long responses share the last microbatches, which hold the most
tokens, so `local` (a mean of per-microbatch means) gives each of their tokens a fraction of the
weight of a short response's token (about the ratio of short to long response lengths). `token`
and the constant give every token the same weight; `sequence` and `group`, like `local` here, give
every sequence (group) about the same total weight whatever its length. Prediction for the
`bimodal` task, whose hard cases (n = 13-16) need long responses: under `length`, `local` learns
the long cases slower than `token`, so the paired difference `local` - `token` of the final
policy's eval reward on n = 13-16 is negative, with its interval below zero, and `local` needs more
steps to reach the threshold; `sequence` and `group` fall on `local`'s side, the constant on
`token`'s; under `balanced`, `local` is indistinguishable from `token` (interval around zero). On
`repeat` the same direction on n = 13-16, smaller. Clipping (most steps are clipped to norm 1.0)
rescales each update to the same norm but keeps its direction, so turning it off should not remove
the effect. With 5 seeds and 60 steps an effect of a few hundredths of reward may not resolve; if
so, that is the result."""


def cells(tasks=TASKS) -> list[dict]:
    """Every cell of the study: (task, mode, shard, clip)."""
    out = []
    for task in tasks:
        out += [dict(task=task, mode=mode, shard="length", clip=True) for mode in MODES]
        out.append(dict(task=task, mode="local", shard="balanced", clip=True))
        if task == "bimodal":  # the clipping-off column, on the task with the sharp prediction
            out += [dict(task=task, mode=mode, shard="length", clip=False) for mode in ("local", "token")]
    return out


def cell_name(cell: dict) -> str:
    return f"{cell['task']}/{cell['mode']}/{cell['shard']}" + ("" if cell["clip"] else "/noclip")


def denominator_flag(mode: str, sequences: int, max_new_tokens: int) -> str:
    """The --loss-denominator of a mode; the constant is Dr GRPO's C = S x max-new-tokens."""
    return str(sequences * max_new_tokens) if mode == "constant" else mode


def train_flags(cell: dict, seed: int, args) -> list[str]:
    sequences = args.prompts_per_step * args.group_size
    return ["--task", cell["task"], "--loss-denominator", denominator_flag(cell["mode"], sequences, args.max_new_tokens),
            "--shard", cell["shard"], "--grad-accum-steps", "4", "--steps", str(args.steps),
            "--prompts-per-step", str(args.prompts_per_step), "--group-size", str(args.group_size),
            "--max-new-tokens", str(args.max_new_tokens), "--max-grad-norm", str(1.0 if cell["clip"] else NO_CLIP),
            "--warmup-steps", str(args.warmup_steps), "--seed", str(seed), "--save-every", "0", "--no-plot", "--log-every", str(args.steps)]


# ------------------------------------------------------------------ one process = W 2 x A 2


def check_single_process(lengths: torch.Tensor, group_size: int, sequences_c: float) -> None:
    """(W = 1, A = 4) gives every token the weight (W = 2, A = 2) gives it, in every mode, under
    ``length`` and ``balanced``: exact equality of the (S, R) weight tensors, else an AssertionError.
    A control (``interleave``, which deals rows to ranks in another order) must differ under local."""
    R = int(lengths.max())
    mask = torch.arange(R)[None, :] < lengths[:, None]  # (S, R)
    group_ids = torch.arange(len(lengths)) // group_size
    num_groups = int(group_ids.max()) + 1
    for shard in ("length", "balanced"):
        for mode in ("local", "token", "sequence", "group", sequences_c):
            d = parse_denominator(str(mode))
            w22 = effective_weights(mask, group_ids, num_groups, d, make_plan(shard, lengths, 2, 2))
            w14 = effective_weights(mask, group_ids, num_groups, d, make_plan(shard, lengths, 1, 4))
            assert torch.equal(w22, w14), f"(W=1, A=4) differs from (W=2, A=2) under {shard}, {mode}"
    w22 = effective_weights(mask, group_ids, num_groups, "local", make_plan("interleave", lengths, 2, 2))
    w14 = effective_weights(mask, group_ids, num_groups, "local", make_plan("interleave", lengths, 1, 4))
    assert not torch.equal(w22, w14), "control: interleave must deal rows differently at (2, 2) and (1, 4)"


# ------------------------------------------------------------------ evaluating a finished run


@torch.no_grad()
def evaluate(run_dir: Path, cfg: dict, group_size: int, sequences_c: float) -> dict:
    """The final policy's mean reward per target length n, on every letter x every n of its task,
    ``EVAL_SAMPLES`` samples each at temperature 1 (fixed noise); checks the single-process plan on
    the lengths of these samples."""
    task = builtin_task(cfg["task"], cfg["max_new_tokens"])
    model = TinyGPT(GPTConfig(task.vocab_size, task.block_size, cfg["n_layer"], cfg["n_head"], cfg["n_embd"]))
    model.load_state_dict(read_tensors(latest_checkpoint(run_dir), "model"))
    model.eval()
    counts = task.counts or tuple(range(task.n_min, task.n_max + 1))
    pairs = [(c, n) for c in task.letters for n in counts for _ in range(EVAL_SAMPLES)]
    prompts = torch.tensor([task.prompt_ids(c, n) for c, n in pairs])
    tokens = generate(model, prompts, task.max_new_tokens, task.tokenizer.eos_id, task.tokenizer.pad_id,
                      temperature=1.0, generator=torch.Generator().manual_seed(1234))
    responses = tokens[:, task.prompt_len:]
    rewards = task.reward(responses, [c * n for c, n in pairs])
    lengths = response_mask(responses, task.tokenizer.eos_id).sum(1)
    S = len(lengths) - len(lengths) % (4 * group_size)
    check_single_process(lengths[torch.randperm(len(lengths), generator=torch.Generator().manual_seed(0))][:S],
                         group_size, sequences_c)
    ns = torch.tensor([n for _, n in pairs])
    return {int(n): float(rewards[ns == n].mean()) for n in counts}


# ------------------------------------------------------------------ one run, read back


def run_one(cell: dict, seed: int, args, run_dir: Path) -> dict:
    """Train (or reuse a finished run with the same flags) and read back its numbers."""
    flags = train_flags(cell, seed, args)
    done_file = run_dir / "study_run.json"
    if done_file.is_file():
        cached = json.loads(done_file.read_text())
        if cached.get("flags") == flags:
            return cached
    start = time.perf_counter()
    cmd = [sys.executable, str(TRAIN), *flags, "--output-dir", str(run_dir), "--overwrite"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    seconds = time.perf_counter() - start
    metrics = read_metrics(run_dir / "metrics.jsonl")
    cfg = json.loads((run_dir / "config.json").read_text())
    cfg = cfg.get("config", cfg)
    sequences = args.prompts_per_step * args.group_size
    eval_by_n = evaluate(run_dir, cfg, args.group_size, sequences * args.max_new_tokens)
    series = {k: np.array([row[k] for row in metrics], dtype=float)
              for k in ("reward_mean", "response_len_mean", "grad_norm")}
    limit = 1.0 if cell["clip"] else NO_CLIP
    out = {
        "flags": flags, "seed": seed, "seconds": seconds,
        "reward_curve": [round(x, 4) for x in series["reward_mean"].tolist()],
        "length_curve": [round(x, 3) for x in series["response_len_mean"].tolist()],
        "final_reward": float(series["reward_mean"][-WINDOW:].mean()),
        "length_drift": float(series["response_len_mean"][-WINDOW:].mean() - series["response_len_mean"][:WINDOW].mean()),
        "length_start": float(series["response_len_mean"][:WINDOW].mean()),
        "clipped_fraction": float((series["grad_norm"] > 1.0).mean()),  # > 1.0: what the clip would cut
        "clipped_fraction_applied": float((series["grad_norm"] > limit).mean()),
        "grad_norm_median": float(np.median(series["grad_norm"])),
        "skew_max": float(np.mean([row["skew_max"] for row in metrics if row.get("skew_max") is not None])),
        "skew_min": float(np.mean([row["skew_min"] for row in metrics if row.get("skew_min") is not None])),
        "eval_by_n": eval_by_n,
    }
    done_file.write_text(json.dumps(out))
    return out


# ------------------------------------------------------------------ per cell, with intervals


def summarize(cell: dict, runs: list[dict], threshold: float, steps: int) -> dict:
    s: dict = {}
    reached = [steps_to_threshold(r["reward_curve"], threshold, WINDOW) for r in runs]
    s["steps_to_threshold"] = bootstrap_ci([steps if k is None else k for k in reached]).to_dict()
    s["reached"] = sum(k is not None for k in reached)
    for key in ("final_reward", "length_drift", "length_start", "clipped_fraction", "skew_max", "skew_min"):
        s[key] = bootstrap_ci([r[key] for r in runs]).to_dict()
    for name, (lo, hi) in BUCKETS[cell["task"]].items():
        s[f"eval_reward_{name}"] = bootstrap_ci([bucket(r, lo, hi) for r in runs]).to_dict()
    return s


def bucket(run: dict, lo: int, hi: int) -> float:
    vals = [v for n, v in run["eval_by_n"].items() if lo <= int(n) <= hi]
    return float(np.mean(vals))


def comparisons(results: list[dict], thresholds: dict, steps: int) -> list[dict]:
    """Paired differences (seed by seed) of each cell against ``token`` under length with clipping."""
    out = []
    by_key = {(c["task"], c["mode"], c["shard"], c["clip"]): c for c in results}
    for c in results:
        ref_key = (c["task"], "token", "length", c["clip"])
        if (c["task"], c["mode"], c["shard"], c["clip"]) == ref_key or ref_key not in by_key:
            continue
        ref = by_key[ref_key]
        seeds = sorted(set(r["seed"] for r in c["runs"]) & set(r["seed"] for r in ref["runs"]))
        a = {r["seed"]: r for r in c["runs"]}
        b = {r["seed"]: r for r in ref["runs"]}
        row = {"task": c["task"], "cell": cell_name(c), "against": cell_name(ref), "seeds": seeds}
        th = thresholds[c["task"]]

        def stt(r):
            k = steps_to_threshold(r["reward_curve"], th, WINDOW)
            return steps if k is None else k
        row["steps_to_threshold"] = paired_difference([stt(a[s]) for s in seeds], [stt(b[s]) for s in seeds]).to_dict()
        row["final_reward"] = paired_difference([a[s]["final_reward"] for s in seeds],
                                                [b[s]["final_reward"] for s in seeds]).to_dict()
        for name, (lo, hi) in BUCKETS[c["task"]].items():
            row[f"eval_reward_{name}"] = paired_difference([bucket(a[s], lo, hi) for s in seeds],
                                                           [bucket(b[s], lo, hi) for s in seeds]).to_dict()
        out.append(row)
    return out


# ------------------------------------------------------------------ outputs


def fmt(iv: dict, digits: int = 3) -> str:
    return f"{iv['mean']:.{digits}f} [{iv['lo']:.{digits}f}, {iv['hi']:.{digits}f}]"


def fmt_diff(iv: dict, digits: int = 3) -> str:
    return str(Interval(**iv)) if digits == 3 else f"{iv['mean']:+.{digits}f} [{iv['lo']:+.{digits}f}, {iv['hi']:+.{digits}f}]"


def outcome(study: dict) -> str:
    """The prediction's outcome, from the numbers (never typed by hand)."""
    lines = []
    comps = {(c["task"], c["cell"]): c for c in study["comparisons"]}
    for task in study["tasks"]:
        long_bucket = list(BUCKETS[task])[-1]
        for mode, shard in (("local", "length"), ("sequence", "length"), ("group", "length"),
                            ("constant", "length"), ("local", "balanced")):
            key = (task, f"{task}/{mode}/{shard}")
            if key not in comps:
                continue
            c = comps[key]
            d, st = Interval(**c[f"eval_reward_{long_bucket}"]), Interval(**c["steps_to_threshold"])
            verdict = ("lower" if d.hi < 0 else "higher" if d.lo > 0 else "no difference resolved")
            lines.append(f"- `{task}`, `{mode}` under `{shard}` minus `token`: eval reward on n = {long_bucket} "
                         f"{d} ({verdict}); steps to threshold {st.mean:+.1f} [{st.lo:+.1f}, {st.hi:+.1f}]; "
                         f"final rollout reward {Interval(**c['final_reward'])}.")
        key = (task, f"{task}/local/length/noclip")
        if key in comps:
            c = comps[key]
            lines.append(f"- `{task}`, clipping off, `local` minus `token` under `length`: eval reward on n = "
                         f"{long_bucket} {Interval(**c[f'eval_reward_{long_bucket}'])}; final rollout reward "
                         f"{Interval(**c['final_reward'])}.")
    return "\n".join(lines)


def held(study: dict) -> str:
    """One sentence: did the central prediction (bimodal, local < token on the long bucket) hold?"""
    c = next((c for c in study["comparisons"] if c["cell"] == "bimodal/local/length"), None)
    if c is None:
        return "The central cell (bimodal, local under length) was not run."
    d = Interval(**c["eval_reward_13-16"])
    if d.hi < 0:
        return f"The central prediction held: on `bimodal`, `local` under `length` minus `token` on n = 13-16 is {d}."
    if d.lo > 0:
        return f"The central prediction failed in the opposite direction: `local` minus `token` on n = 13-16 is {d}."
    return (f"The central prediction did not hold at this size: `local` minus `token` on n = 13-16 is {d}, "
            "an interval that includes zero (no effect resolved with these seeds).")


def write_markdown(study: dict, path: Path) -> None:
    m = study["meta"]
    lines = [
        "# The controlled study: do the denominators change what GRPO learns?",
        "",
        f"Regenerate with `make study` (`{m['command']}`). Commit `{m['commit']}`; {m['when']}; "
        f"{m['runs']} runs, {m['jobs']} at a time, one thread each, on {m['cpus']} CPU cores; wall time "
        f"{m['wall_s'] / 60:.1f} min; load average (1 min) {m['load_start'][0]:.2f} at the start, "
        f"{m['load_end'][0]:.2f} at the end, mean {m['load_mean']:.2f} over the runs' ends (other jobs "
        "shared the machine: the rewards do not depend on load, only the wall time does).",
        "",
        f"Every run: `python gradnorm/train.py` with {m['steps']} GRPO steps of {m['prompts_per_step']} prompts x "
        f"{m['group_size']} completions after a {warmup_steps(study)}-step supervised warm-up, one process with "
        "`--grad-accum-steps 4`, which gives every token the weight 2 ranks x 2 microbatches give it "
        "(checked exactly in every run, see benchmarks/study.py), seeds "
        f"{', '.join(map(str, m['seeds']))}. Flags of each cell are in study.json. The constant is "
        f"Dr GRPO's C = S x max-new-tokens = {m['constant']}.",
        "",
        "## The prediction (written before the full run)",
        "",
        study["prediction"],
        "",
        "## The outcome",
        "",
        held(study),
        "",
        outcome(study),
        "",
        f"Thresholds (trailing {WINDOW}-step mean rollout reward), picked from the pilot before the full run: "
        + ", ".join(f"`{t}` {v}" for t, v in study["threshold"].items()) + ". ",
        "",
        "![study](study.png)",
        "",
    ]
    for task in study["tasks"]:
        names = list(BUCKETS[task])
        lines += [f"## Task `{task}`: per cell, mean over seeds [95% bootstrap interval]", "",
                  "| cell | steps to threshold (reached) | final reward | " + " | ".join(f"eval n {b}" for b in names)
                  + " | length drift | start length | clipped steps (norm > 1) | skew max | skew min |",
                  "|---|---|---|" + "---|" * len(names) + "---|---|---|---|---|"]
        for c in study["cells"]:
            if c["task"] != task:
                continue
            s = c["summary"]
            lines.append(f"| {cell_name(c)} | {fmt(s['steps_to_threshold'], 0)} ({s['reached']}/{len(c['runs'])}) | "
                         f"{fmt(s['final_reward'])} | " + " | ".join(fmt(s[f'eval_reward_{b}']) for b in names)
                         + f" | {fmt(s['length_drift'], 2)} | {fmt(s['length_start'], 2)} | "
                         f"{fmt(s['clipped_fraction'], 2)} | {fmt(s['skew_max'], 2)} | {fmt(s['skew_min'], 2)} |")
        lines += ["", f"Paired differences against `{task}/token/length` (same clip setting), seed by seed:", "",
                  "| cell | steps to threshold | final reward | " + " | ".join(f"eval n {b}" for b in names) + " |",
                  "|---|---|---|" + "---|" * len(names)]
        for c in study["comparisons"]:
            if c["task"] == task:
                lines.append(f"| {c['cell']} - {c['against'].split('/', 1)[1]} | {fmt_diff(c['steps_to_threshold'], 1)} | "
                             f"{fmt_diff(c['final_reward'])} | " + " | ".join(fmt_diff(c[f'eval_reward_{b}']) for b in names) + " |")
        lines.append("")
    lines += [
        "Reading the columns: steps to threshold counts a run that never reached it as its last step; final reward "
        f"is the mean rollout reward of the last {WINDOW} steps; eval n a-b is the final policy's reward on every "
        f"letter x every n in a..b, {EVAL_SAMPLES} samples each at temperature 1; length drift is the mean response "
        f"length of the last {WINDOW} steps minus the first {WINDOW}; clipped steps is the fraction of steps whose "
        "gradient norm before clipping exceeded 1.0 (in the no-clipping cells, what clipping would have cut); "
        "skew max / min are the trainer's logged per-step largest and smallest ratio of the weight `local` gives a "
        "token to the weight the run's own mode gives it (for `local` runs: to `token`'s), averaged over steps: how "
        "much louder or quieter the per-microbatch mean would make a token (1.0 = no skew; under `balanced` "
        "`local` is close to `token`). With 5 seeds a bootstrap interval is rough: it says how far apart the seeds "
        "are, not more.",
        "",
    ]
    path.write_text("\n".join(lines))


def warmup_steps(study: dict) -> int:
    """The --warmup-steps every run of the study used (read from the runs' flags)."""
    values = {r["flags"][r["flags"].index("--warmup-steps") + 1] for c in study["cells"] for r in c["runs"]}
    assert len(values) == 1, f"the runs used different warm-ups: {values}"
    return int(values.pop())


def write_figure(study: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from gradnorm.teach.study import plot_bucket_rewards, plot_effects, plot_reward_curves

    tasks = study["tasks"]
    fig, axes = plt.subplots(3, len(tasks), figsize=(6.5 * len(tasks), 13), squeeze=False)
    for k, task in enumerate(tasks):
        here = [(c["mode"], c["shard"], c["clip"]) for c in study["cells"] if c["task"] == task]
        plot_reward_curves(axes[0, k], study, task, [c for c in here if c[2]])
        axes[0, k].legend(fontsize=7, loc="upper left")
        plot_bucket_rewards(axes[1, k], study, task, here)
        axes[1, k].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3)
        plot_effects(axes[2, k], study, task, f"eval_reward_{list(BUCKETS[task])[-1]}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------ main


def git_commit() -> str:
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    dirty = git("diff", "HEAD", "--name-only").split()
    return head + (f" (with uncommitted changes to {', '.join(dirty)})" if dirty else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks", help="where study.md, study.json and study.png go")
    p.add_argument("--runs-dir", default="runs/study", help="the runs' directories (finished runs are reused)")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=20)
    p.add_argument("--warmup-steps", type=int, default=20, help="supervised warm-up steps before GRPO")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (one per core)")
    # Picked from the pilot (seed 0, 80 steps): both tasks' trailing mean passed 0.40 between steps
    # 40 and 50 under local and token, well inside the 60 steps of the full run.
    p.add_argument("--threshold-bimodal", type=float, default=0.40)
    p.add_argument("--threshold-repeat", type=float, default=0.40)
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--report-only", action="store_true",
                   help="rewrite study.md and study.png from the study.json in --out (no runs)")
    p.add_argument("--pilot", action="store_true", help="local and token under length, one seed: timing and thresholds, nothing written")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.report_only:
        study = json.loads((Path(args.out) / "study.json").read_text())
        write_markdown(study, Path(args.out) / "study.md")
        write_figure(study, Path(args.out) / "study.png")
        return 0
    tasks = tuple(args.tasks.split(","))
    todo_cells = cells(tasks)
    seeds = list(range(args.seeds))
    if args.pilot:
        todo_cells = [c for c in todo_cells if c["shard"] == "length" and c["clip"] and c["mode"] in ("local", "token")]
        seeds = [0]
    thresholds = {"bimodal": args.threshold_bimodal, "repeat": args.threshold_repeat}
    runs_dir = Path(args.runs_dir)
    # Seed-major order: if the study is stopped, every cell has the same seeds so far.
    jobs = [(ci, seed) for seed in seeds for ci in range(len(todo_cells))]
    results: dict[tuple[int, int], dict] = {}
    loads = []
    lock = threading.Lock()
    start = time.perf_counter()
    load_start = os.getloadavg()
    commit = git_commit()  # at the start: the code the runs ran
    print(f"study: {len(jobs)} runs, {args.jobs} at a time, {args.steps} steps each", file=sys.stderr, flush=True)

    def one(ci, seed):
        cell = todo_cells[ci]
        return run_one(cell, seed, args, runs_dir / cell_name(cell).replace("/", "_") / f"seed{seed}")

    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(one, ci, seed): (ci, seed) for ci, seed in jobs}
        for n, fut in enumerate(as_completed(futures), start=1):
            ci, seed = futures[fut]
            results[(ci, seed)] = fut.result()
            with lock:
                loads.append(os.getloadavg()[0])
            elapsed = time.perf_counter() - start
            eta = elapsed / n * (len(jobs) - n)
            print(f"[{n}/{len(jobs)}] {cell_name(todo_cells[ci])} seed {seed}: {results[(ci, seed)]['seconds']:.0f} s, "
                  f"reward {results[(ci, seed)]['final_reward']:.3f}, elapsed {elapsed / 60:.1f} min, "
                  f"eta {eta / 60:.1f} min", file=sys.stderr, flush=True)
    wall = time.perf_counter() - start
    if args.pilot:
        for (ci, seed), r in results.items():
            print(cell_name(todo_cells[ci]), {k: r[k] for k in ("seconds", "final_reward", "eval_by_n", "clipped_fraction")})
            print("  trailing mean every 10 steps:", np.round(moving_average(r["reward_curve"], WINDOW)[9::10], 3).tolist())
            for th in (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8):
                print(f"  steps to {th}: {steps_to_threshold(r['reward_curve'], th, WINDOW)}")
        return 0

    sequences = args.prompts_per_step * args.group_size
    study_cells = []
    for ci, cell in enumerate(todo_cells):
        runs = [results[(ci, s)] for s in seeds]
        study_cells.append({**cell, "runs": runs, "summary": summarize(cell, runs, thresholds[cell["task"]], args.steps)})
    study = {
        "meta": {
            "command": "python benchmarks/study.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "commit": commit, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "runs": len(jobs), "jobs": args.jobs, "cpus": os.cpu_count(), "wall_s": wall,
            "load_start": list(load_start), "load_end": list(os.getloadavg()), "load_mean": float(np.mean(loads)),
            "steps": args.steps, "prompts_per_step": args.prompts_per_step, "group_size": args.group_size,
            "seeds": seeds, "constant": sequences * args.max_new_tokens,
            "python": platform.python_version(), "torch": torch.__version__,
        },
        "prediction": PREDICTION,
        "tasks": list(tasks),
        "threshold": {t: thresholds[t] for t in tasks},
        "buckets": {t: list(BUCKETS[t]) for t in tasks},
        "cells": study_cells,
    }
    study["comparisons"] = comparisons(study_cells, thresholds, args.steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.json").write_text(json.dumps(study, indent=1) + "\n")
    write_markdown(study, out / "study.md")
    write_figure(study, out / "study.png")
    print(f"wrote {out / 'study.md'}, {out / 'study.json'}, {out / 'study.png'} in {wall / 60:.1f} min", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
