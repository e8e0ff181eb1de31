"""The controlled study's statistics and figures: what ``benchmarks/study.py`` computes per run and
per cell, and what notebook 03 draws from its committed ``benchmarks/study.json``.

Statistics (pure numpy, no training):

- ``steps_to_threshold``: the first step whose trailing mean reward reaches a threshold, or None;
- ``bootstrap_ci``: the mean over seeds and its percentile bootstrap interval (resampling seeds);
- ``paired_difference``: the mean difference of two cells seed by seed (runs of the same seed share
  the warm-up policy and their first rollout batch) and its bootstrap interval.

Figures draw on a given matplotlib Axes: ``plot_reward_curves`` (mean over seeds of the trailing
reward per step), ``plot_bucket_rewards`` (the final policy's reward per target-length bucket,
with intervals), ``plot_effects`` (each cell minus ``token``, paired by seed, with intervals) and
``plot_effect_grid`` (one ``plot_effects`` per measure and task). Readings of the results:
``resolved_differences`` (every difference whose interval excludes zero, either direction),
``study_band_exits`` (how often a held-out seed leaves the other seeds' band), ``mean_n_over_c``
(the constant's step scale) and ``live_settings`` (a new run with a cell's own flags).

The multiple comparisons (notebook 03, section 2): ``MAIN_MEASURE``, the one difference the
prediction named before the runs, is tested alone; the rest are exploratory under Holm's
correction (``holm``). ``tested_differences`` recomputes each difference seed by seed from the
runs (``seed_differences``) and gives it a paired Student-t interval and p-value (``t_interval``,
``paired_t_p``, on ``t_two_sided_p`` and ``t_quantile``, numpy only): at 5 seeds the percentile
bootstrap excludes zero far more often than its nominal 5% when nothing differs, which
``null_exclusion_rate`` measures. ``plot_finding`` draws the result.
Colours are the palette's: a mode a colour, a sharding a line style. Nothing here starts a process.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gradnorm.teach.palette import MODE_COLORS, SHARD_STYLES
from gradnorm.trainer.logs.curves import moving_average

STUDY_JSON = Path(__file__).resolve().parents[2] / "benchmarks" / "study.json"
"""Where ``make study`` writes its results (notebook 03 reads them)."""


@dataclass(frozen=True)
class Interval:
    """A mean over seeds and its bootstrap interval [lo, hi]."""

    mean: float
    lo: float
    hi: float

    def excludes_zero(self) -> bool:
        return self.lo > 0 or self.hi < 0

    def verdict(self, against: str = "token") -> str:
        """What the interval of a difference (a cell minus ``against``) resolves."""
        return f"lower than {against}" if self.hi < 0 else f"higher than {against}" if self.lo > 0 else "no difference resolved"

    def __str__(self) -> str:
        return f"{self.mean:+.3f} [{self.lo:+.3f}, {self.hi:+.3f}]"

    def to_dict(self) -> dict:
        return {"mean": self.mean, "lo": self.lo, "hi": self.hi}


def steps_to_threshold(rewards: Sequence[float], threshold: float, window: int = 10) -> int | None:
    """The first step (1-based) whose trailing ``window``-step mean reward is >= ``threshold``, or
    None if no step reaches it (the run is censored at its last step).

    The trailing mean starts over fewer steps (``moving_average``), so the first steps count with
    the noise of a shorter window.
    """
    reached = np.flatnonzero(moving_average(np.asarray(rewards, dtype=float), window) >= threshold)
    return int(reached[0]) + 1 if len(reached) else None


def bootstrap_ci(values: Sequence[float], n_resamples: int = 2000, level: float = 0.95, seed: int = 0) -> Interval:
    """The mean of ``values`` (one per seed) and its percentile bootstrap interval.

    Each resample draws len(values) seeds with replacement and takes their mean; the interval is
    the central ``level`` of those means. With 5 seeds it is a rough interval (a resample holds at
    most 5 distinct values), honest about how little 5 seeds say, not a precise one.
    """
    x = np.asarray(values, dtype=float)
    if x.ndim != 1 or len(x) == 0 or not np.isfinite(x).all():
        raise ValueError(f"bootstrap_ci needs a non-empty 1-D array of finite values, got {x!r}")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(n_resamples, len(x)))].mean(axis=1)  # (n_resamples,)
    tail = (1 - level) / 2
    lo, hi = np.quantile(means, [tail, 1 - tail])
    return Interval(float(x.mean()), float(lo), float(hi))


def paired_difference(a: Sequence[float], b: Sequence[float], **kwargs) -> Interval:
    """a - b seed by seed (a[i] and b[i] come from the same seed), with its bootstrap interval."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired values need the same seeds: {a.shape} vs {b.shape}")
    return bootstrap_ci(a - b, **kwargs)


# ------------------------------------------------------------------ reading and drawing the results


def load_study(path: str | Path = STUDY_JSON) -> dict:
    """The committed results of ``make study`` (benchmarks/study.json)."""
    return json.loads(Path(path).read_text())


def cell_runs(study: dict, task: str, mode: str, shard: str = "length", clip: bool = True) -> list[dict]:
    """The runs (one per seed) of one cell of the study."""
    for cell in study["cells"]:
        if (cell["task"], cell["mode"], cell["shard"], cell["clip"]) == (task, mode, shard, clip):
            return cell["runs"]
    raise KeyError(f"no cell {task}, {mode}, {shard}, clip={clip} in the study")


def cell_style(mode: str, shard: str, clip: bool) -> dict:
    """The palette's colour of the mode; the sharding's line style; clipping off drawn thin."""
    return {"color": MODE_COLORS[mode], "ls": SHARD_STYLES[shard]["ls"], "lw": 2.0 if clip else 1.0}


def cell_label(mode: str, shard: str, clip: bool) -> str:
    return f"{mode}, {shard}" + ("" if clip else ", clipping off")


def plot_reward_curves(ax, study: dict, task: str, cells: Sequence[tuple[str, str, bool]], window: int = 10) -> None:
    """Trailing-mean rollout reward per step: mean over seeds (line) and the seeds' range (band),
    for each (mode, shard, clip) of ``task``; the dotted grey line is the task's threshold."""
    for mode, shard, clip in cells:
        runs = cell_runs(study, task, mode, shard, clip)
        curves = np.array([moving_average(r["reward_curve"], window) for r in runs])  # (seeds, steps)
        steps = np.arange(1, curves.shape[1] + 1)
        style = cell_style(mode, shard, clip)
        ax.plot(steps, curves.mean(0), label=cell_label(mode, shard, clip), **style)
        ax.fill_between(steps, curves.min(0), curves.max(0), color=style["color"], alpha=0.08, lw=0)
    ax.axhline(study["threshold"][task], color="0.5", lw=0.8, ls=":", label=f"threshold {study['threshold'][task]}")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel(f"rollout reward ({window}-step trailing mean)")
    ax.set_title(f"{task}: mean of {len(runs)} seeds (band: their range)")


def plot_bucket_rewards(ax, study: dict, task: str, cells: Sequence[tuple[str, str, bool]]) -> None:
    """The final policy's eval reward per target-length bucket: bars = mean over seeds, whiskers =
    the 95% bootstrap interval (the ``summary`` of each cell)."""
    buckets = study["buckets"][task]
    width = 0.8 / len(cells)
    for k, (mode, shard, clip) in enumerate(cells):
        summary = cell_summary(study, task, mode, shard, clip)
        ivs = [summary[f"eval_reward_{b}"] for b in buckets]
        x = np.arange(len(buckets)) + (k - (len(cells) - 1) / 2) * width
        mean = np.array([iv["mean"] for iv in ivs])
        err = np.array([[iv["mean"] - iv["lo"] for iv in ivs], [iv["hi"] - iv["mean"] for iv in ivs]])
        style = cell_style(mode, shard, clip)
        ax.bar(x, mean, width, yerr=err, capsize=2, label=cell_label(mode, shard, clip), color=style["color"],
               alpha=1.0 if shard == "length" else 0.45, hatch=None if clip else "//")
    ax.set_xticks(np.arange(len(buckets)), [f"n = {b}" for b in buckets])
    ax.set_ylabel("eval reward of the final policy")
    ax.set_title(f"{task}: eval reward by n (95% CI)")


def plot_effects(ax, study: dict, task: str, key: str, rows: Sequence[str] | None = None) -> list[tuple[str, Interval]]:
    """Each cell minus ``token`` under ``length`` (same seeds, same clip setting) on ``key``
    (e.g. ``eval_reward_13-16``): a dot at the mean difference, a bar over its 95% bootstrap
    interval, and the zero line, kept off the axis' edge. ``rows`` (default: this task's cells)
    fixes the row order, so panels of different tasks line up (a cell the task lacks is a blank
    row). Returns the (cell, interval) pairs drawn, top to bottom."""
    comps = {c["cell"].split("/", 1)[1]: c for c in study["comparisons"] if c["task"] == task}
    rows = list(comps) if rows is None else list(rows)
    drawn = []
    for y, name in enumerate(rows):
        if name not in comps:
            continue
        iv = Interval(**comps[name][key])
        mode, shard, *rest = name.split("/")
        style = cell_style(mode, shard, not rest)
        ax.plot([iv.lo, iv.hi], [y, y], color=style["color"], ls=style["ls"], lw=2)
        ax.plot([iv.mean], [y], "o", color=style["color"])
        drawn.append((f"{name} - {comps[name]['against'].split('/', 1)[1]}", iv))
    ax.axvline(0.0, color="0.3", lw=0.8)
    lo = min([0.0] + [iv.lo for _, iv in drawn])
    hi = max([0.0] + [iv.hi for _, iv in drawn])
    pad = 0.08 * (hi - lo or 1.0)
    ax.set_xlim(lo - pad, hi + pad)
    ax.set_yticks(range(len(rows)), [row_label(name) for name in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel(f"difference in {key.replace('_', ' ')} (paired by seed, 95% bootstrap CI)")
    ax.set_title(f"{task}: minus token, paired by seed")
    return drawn


def comparison(study: dict, cell: str, key: str) -> Interval:
    """The paired difference of ``cell`` (e.g. "bimodal/local/length") minus its reference on ``key``."""
    for c in study["comparisons"]:
        if c["cell"] == cell:
            return Interval(**c[key])
    raise KeyError(f"no comparison for {cell} in the study")


def cell_summary(study: dict, task: str, mode: str, shard: str = "length", clip: bool = True) -> dict:
    """The per-cell summary (mean and interval of every measure) of one cell."""
    for cell in study["cells"]:
        if (cell["task"], cell["mode"], cell["shard"], cell["clip"]) == (task, mode, shard, clip):
            return cell["summary"]
    raise KeyError(f"no cell {task}, {mode}, {shard}, clip={clip} in the study")


# ------------------------------------------------------------------ every difference, the band, the live run


def differences(study: dict) -> list[tuple[str, str, str, Interval]]:
    """Every paired difference the study recorded: (cell, reference, measure, interval), for every
    comparison and every measure in it (steps to threshold, final reward, each eval bucket)."""
    out = []
    for c in study["comparisons"]:
        for key, iv in c.items():
            if isinstance(iv, dict) and set(iv) == {"mean", "lo", "hi"}:
                out.append((c["cell"], c["against"], key, Interval(**iv)))
    return out


def resolved_differences(study: dict) -> tuple[list[tuple[str, str, str, Interval]], list[tuple[str, str, str, Interval]]]:
    """``differences`` split into those whose interval excludes zero (either direction) and the rest."""
    rows = differences(study)
    return [r for r in rows if r[3].excludes_zero()], [r for r in rows if not r[3].excludes_zero()]


def plot_effect_grid(axes, study: dict, keys: Sequence[str]) -> None:
    """Small multiples of ``plot_effects``: one row per measure in ``keys``, one column per task
    (``axes`` of shape (len(keys), tasks)); a measure a task lacks leaves its Axes off."""
    for row, key in enumerate(keys):
        for col, task in enumerate(study["tasks"]):
            ax = axes[row][col]
            if not any(c["task"] == task and key in c for c in study["comparisons"]):
                ax.set_axis_off()
                continue
            plot_effects(ax, study, task, key, rows=comparison_rows(study))
            ax.set_title(f"{task}: {key.replace('_', ' ')}, minus token")


def band_exits(curves: np.ndarray, steps: int | None = None) -> dict:
    """Leave one seed out: how often it leaves the range (min to max) of the other seeds.

    ``curves`` is (seeds, steps). Returns ``any``: the fraction of seeds that lie outside the
    others' range at some step (of the first ``steps``), and ``steps``: the mean fraction of steps
    they lie outside it."""
    x = np.asarray(curves, dtype=float)[:, :steps]
    if x.ndim != 2 or len(x) < 3:
        raise ValueError(f"band_exits needs (seeds >= 3, steps) curves, got shape {x.shape}")
    outside = []
    for i in range(len(x)):
        rest = np.delete(x, i, axis=0)
        outside.append((x[i] < rest.min(0)) | (x[i] > rest.max(0)))
    outside = np.array(outside)
    return {"any": float(outside.any(1).mean()), "steps": float(outside.mean())}


def study_band_exits(study: dict, window: int = 10, steps: int | None = None) -> dict:
    """``band_exits`` of the trailing reward, over every cell of the study: the fraction of
    (cell, held-out seed) pairs that leave the other seeds' band at some step, the mean fraction of
    steps outside it, and the number of seeds in each band (one fewer than the study's)."""
    anys, fracs = [], []
    for c in study["cells"]:
        curves = np.array([moving_average(r["reward_curve"], window) for r in c["runs"]])
        e = band_exits(curves, steps)
        anys.append(e["any"])
        fracs.append(e["steps"])
    return {"any": float(np.mean(anys)), "steps": float(np.mean(fracs)), "band_seeds": len(study["meta"]["seeds"]) - 1}


def mean_n_over_c(runs: Sequence[dict], max_new_tokens: int) -> float:
    """The mean over runs and steps of N / C for Dr GRPO's C = S x max-new-tokens: the minibatch's
    response tokens N = S x the logged mean response length, so N / C = mean length / max-new-tokens.
    Under the constant a step's update is ``token``'s scaled by this factor (before clipping)."""
    return float(np.mean([np.mean(r["length_curve"]) for r in runs]) / max_new_tokens)


def flag_value(flags: Sequence[str], name: str) -> str:
    return flags[list(flags).index(name) + 1]


LAUNCH_FLAGS = ("--loss-denominator", "--shard", "--grad-accum-steps", "--steps", "--seed")
"""Flags ``gradnorm.teach.launch.train_run`` sets from its own arguments."""


def live_settings(study: dict, task: str, mode: str, shard: str, seed: int, steps: int, prompts: int) -> dict:
    """The keyword arguments of ``train_run`` for one run with the flags of the study's cell
    (``task``, ``mode``, ``shard``, clipping on), except the seed, the number of steps and the prompts
    per step, and the list of those differences (flag, study's value, this run's). A mode the study
    did not run (a number C) takes the flags of ``token`` under ``shard`` with its own denominator."""
    key = mode if mode in {c["mode"] for c in study["cells"]} else "token"
    try:
        flags = list(cell_runs(study, task, key, shard)[0]["flags"])
    except KeyError:
        flags = list(cell_runs(study, task, key, "length")[0]["flags"])
    denominator = flag_value(flags, "--loss-denominator") if key == mode else str(mode)
    ours = {"--loss-denominator": denominator, "--shard": shard, "--steps": str(steps), "--seed": str(seed),
            "--prompts-per-step": str(prompts), "--log-every": str(steps)}
    differ = [(name, flag_value(flags, name), value) for name, value in ours.items() if flag_value(flags, name) != value]
    for name, value in ours.items():
        flags[flags.index(name) + 1] = value
    extra = []
    i = 0
    while i < len(flags):
        if flags[i] in LAUNCH_FLAGS:
            i += 2
            continue
        extra.append(flags[i])
        i += 1
    return {"kwargs": dict(loss_denominator=denominator, shard=shard, steps=steps, seed=seed,
                           grad_accum_steps=int(flag_value(flags, "--grad-accum-steps")), nproc_per_node=1,
                           extra_args=extra),
            "differs": differ}


# ------------------------------------------------------------------ the multiple comparisons

MAIN_MEASURE = ("bimodal/local/length", "eval_reward_13-16")
"""The one difference the prediction named before the runs (its central measure): on ``bimodal``
under ``length``, ``local`` minus ``token`` on the final policy's eval reward for n = 13-16. It is
tested alone at 95%; every other difference the study recorded is exploratory."""

REWARD_KEYS = ("final_reward", "eval_reward_")
"""Measures in units of reward (``steps_to_threshold`` is in steps)."""


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom.

    1 - 2 * integral_0^|t| of the density Gamma((df+1)/2) / (sqrt(df pi) Gamma(df/2)) (1 + x^2/df)^-(df+1)/2,
    by Simpson's rule on 4001 points (accurate to about 1e-10 here), so that no scipy is needed.
    """
    t = abs(float(t))
    if t == 0.0:
        return 1.0
    if not np.isfinite(t):
        return 0.0
    from math import gamma, pi, sqrt
    x = np.linspace(0.0, t, 4001)
    pdf = gamma((df + 1) / 2) / (sqrt(df * pi) * gamma(df / 2)) * (1 + x**2 / df) ** (-(df + 1) / 2)
    h = x[1] - x[0]
    integral = h / 3 * (pdf[0] + pdf[-1] + 4 * pdf[1:-1:2].sum() + 2 * pdf[2:-1:2].sum())
    return float(min(1.0, max(0.0, 1.0 - 2.0 * integral)))


def t_quantile(level: float, df: int) -> float:
    """The t with P(|T| <= t) = ``level`` (e.g. 2.776 for level 0.95 and df 4), by bisection."""
    lo, hi = 0.0, 1e4
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_two_sided_p(mid, df) > 1 - level else (lo, mid)
    return (lo + hi) / 2


def t_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """The mean of ``values`` (one per seed) and its Student-t interval, mean +- t(level, n-1) s / sqrt(n).

    Unlike the percentile bootstrap, it widens for the few degrees of freedom of 5 seeds (2.776
    standard errors at 95%, not about 1.96), so its 95% holds at 5 seeds for roughly normal values."""
    x = np.asarray(values, dtype=float)
    if x.ndim != 1 or len(x) < 2:
        raise ValueError(f"t_interval needs at least 2 values, got {x!r}")
    half = t_quantile(level, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x))
    return Interval(float(x.mean()), float(x.mean() - half), float(x.mean() + half))


def paired_t_p(diffs: Sequence[float]) -> float:
    """Two-sided p-value of the paired t test that the mean of ``diffs`` (a - b seed by seed) is zero."""
    x = np.asarray(diffs, dtype=float)
    se = x.std(ddof=1) / np.sqrt(len(x))
    if se == 0:
        return 1.0 if x.mean() == 0 else 0.0
    return t_two_sided_p(x.mean() / se, len(x) - 1)


def holm(pvalues: Sequence[float], alpha: float = 0.05) -> list[bool]:
    """Holm's step-down correction: which of the hypotheses are rejected with a family-wise error
    rate of at most ``alpha``. The k-th smallest p (k = 0, 1, ...) is compared with alpha / (m - k),
    stopping at the first that fails."""
    order = np.argsort(pvalues, kind="stable")
    rejected = [False] * len(pvalues)
    for k, i in enumerate(order):
        if pvalues[i] > alpha / (len(pvalues) - k):
            break
        rejected[i] = True
    return rejected


def bucket_reward(run: dict, bucket: str) -> float:
    """A run's eval reward on the bucket "lo-hi" of n: the mean over those n (as ``make study`` computes it)."""
    lo, hi = (int(v) for v in bucket.split("-"))
    return float(np.mean([v for n, v in run["eval_by_n"].items() if lo <= int(n) <= hi]))


def run_measure(study: dict, task: str, run: dict, key: str, window: int = 10) -> float:
    """One run's value of a measure: ``final_reward``, ``eval_reward_<bucket>``, or
    ``steps_to_threshold`` (a run that never reaches the threshold counts as the last step)."""
    if key == "steps_to_threshold":
        k = steps_to_threshold(run["reward_curve"], study["threshold"][task], window)
        return float(study["meta"]["steps"] if k is None else k)
    if key.startswith("eval_reward_"):
        return bucket_reward(run, key.removeprefix("eval_reward_"))
    return float(run[key])


def seed_differences(study: dict, cell: str, key: str) -> np.ndarray:
    """``cell`` minus its reference (e.g. "bimodal/local/length" minus "bimodal/token/length") on
    ``key``, seed by seed, recomputed from the runs: the values whose bootstrap the study stored."""
    comp = next((c for c in study["comparisons"] if c["cell"] == cell), None)
    if comp is None:
        raise KeyError(f"no comparison for {cell} in the study")

    def runs(name: str) -> dict:
        task, mode, shard, *rest = name.split("/")
        return {r["seed"]: r for r in cell_runs(study, task, mode, shard, clip=not rest)}
    a, b = runs(comp["cell"]), runs(comp["against"])
    return np.array([run_measure(study, comp["task"], a[s], key) - run_measure(study, comp["task"], b[s], key)
                     for s in comp["seeds"]])


@dataclass(frozen=True)
class Tested:
    """One difference of the study, tested: its bootstrap interval (as stored), its t interval and p."""

    cell: str
    against: str
    key: str
    bootstrap: Interval
    t: Interval
    p: float
    main: bool
    holm: bool  # rejected by Holm's correction over the exploratory family (always False for the main one)


def tested_differences(study: dict, alpha: float = 0.05) -> list[Tested]:
    """Every difference of ``differences``, with its paired t interval and p-value: the main measure
    (``MAIN_MEASURE``) alone at ``alpha``, the rest as one exploratory family under ``holm``."""
    rows = differences(study)
    diffs = [seed_differences(study, cell, key) for cell, _, key, _ in rows]
    ps = [paired_t_p(d) for d in diffs]
    explore = [i for i, (cell, _, key, _) in enumerate(rows) if (cell, key) != MAIN_MEASURE]
    survived = dict(zip(explore, holm([ps[i] for i in explore], alpha)))
    return [Tested(cell, against, key, iv, t_interval(d, 1 - alpha), p, (cell, key) == MAIN_MEASURE,
                   survived.get(i, False))
            for i, ((cell, against, key, iv), d, p) in enumerate(zip(rows, diffs, ps))]


def null_exclusion_rate(n_seeds: int, trials: int = 1000, seed: int = 0) -> dict:
    """How often a 95% interval excludes zero when nothing differs: ``trials`` sets of ``n_seeds``
    standard-normal differences, each given the study's bootstrap interval and the t interval.
    The bootstrap's rate at 5 seeds is far above 5% (it ignores how few seeds there are)."""
    rng = np.random.default_rng(seed)
    boot = t = 0
    for i in range(trials):
        x = rng.normal(size=n_seeds)
        boot += bootstrap_ci(x, seed=i).excludes_zero()
        t += t_interval(x).excludes_zero()
    return {"bootstrap": boot / trials, "t": t / trials}


def reward_gain(study: dict, task: str) -> float:
    """What ``token`` under ``length`` gained over the run: the mean over seeds of the final reward
    (last 10 steps) minus the reward of step 1 (the warm-up policy): the scale for a reward difference."""
    runs = cell_runs(study, task, "token", "length")
    return float(np.mean([r["final_reward"] - r["reward_curve"][0] for r in runs]))


def comparison_rows(study: dict) -> list[str]:
    """The compared cells without their task ("local/length", ..., "local/length/noclip"), in the
    study's order, the union over tasks: one row list, so the panels of every task line up."""
    rows: list[str] = []
    for c in study["comparisons"]:
        name = c["cell"].split("/", 1)[1]
        if name not in rows:
            rows.append(name)
    return rows


def row_label(name: str) -> str:
    """"local/length/noclip" -> "local/length/noclip - token/noclip": each row names its reference."""
    return name + " - token" + ("/noclip" if name.endswith("/noclip") else "")


def plot_finding(axes, study: dict, tested: Sequence[Tested]) -> None:
    """The finding on one Axes per task: every reward difference from ``token`` (rows: cells, the
    same rows in every panel; a dot for the final rollout reward, a square for the long cases
    n = 13-16), with its 95% t interval. The main measure is black; a filled marker survives Holm's
    correction (or, for the main measure, its own 95% test), a hollow one does not. The grey band
    spans +-10% of the reward ``token`` gained over the run, for scale."""
    long_key = "eval_reward_13-16"
    rows = comparison_rows(study)
    for ax, task in zip(axes, study["tasks"]):
        gain = reward_gain(study, task)
        ax.axvspan(-0.1 * gain, 0.1 * gain, color="0.92", lw=0)
        for y, name in enumerate(rows):
            mode, shard, *_ = name.split("/")
            for dy, key, marker in ((-0.15, "final_reward", "o"), (0.15, long_key, "s")):
                r = next((r for r in tested if r.cell == f"{task}/{name}" and r.key == key), None)
                if r is None:
                    continue
                color = "k" if r.main else MODE_COLORS[mode]
                filled = r.holm or (r.main and r.t.excludes_zero())
                ax.plot([r.t.lo, r.t.hi], [y + dy] * 2, color=color, ls=SHARD_STYLES[shard]["ls"],
                        lw=2.5 if r.main else 1.5)
                ax.plot([r.t.mean], [y + dy], marker, color=color, mfc=color if filled else "white", ms=7)
        ax.axvline(0.0, color="0.3", lw=0.8)
        ax.set_yticks(range(len(rows)), [row_label(name) for name in rows] if ax is axes[0] else [])
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_xlabel("reward difference from token (paired by seed, 95% t interval)")
        ax.set_title(f"{task} (grey: +-10% of token's gain over the run, {gain:.2f})", fontsize=10)
    none = "" if any(r.holm for r in tested) else " (none does)"
    handles = [plt_line("k", "s", "main measure (named before the runs), eval n = 13-16"),
               plt_line("0.5", "o", "final rollout reward"), plt_line("0.5", "s", "eval reward, n = 13-16"),
               plt_line("0.5", "o", "filled: survives Holm's correction" + none, filled=True)]
    axes[0].figure.legend(handles=handles, fontsize=8, loc="lower center", ncol=4, frameon=False)


def plt_line(color: str, marker: str, label: str, filled: bool = False):
    from matplotlib.lines import Line2D
    return Line2D([], [], color=color, marker=marker, mfc=color if filled else "white", label=label)
