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
Colours are the palette's: a mode a colour, a sharding a line style. Nothing here starts a process.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gradnorm.teach.palette import MODE_COLORS, SHARD_STYLES
from gradnorm.trainer.rundir.curves import moving_average

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


def plot_effects(ax, study: dict, task: str, key: str) -> list[tuple[str, Interval]]:
    """Each cell minus ``token`` under ``length`` (same seeds, same clip setting) on ``key``
    (e.g. ``eval_reward_13-16``): a dot at the mean difference, a bar over its 95% interval, and
    the zero line. Returns the (cell, interval) pairs drawn, top to bottom."""
    rows = [(c["cell"].split("/", 1)[1] + " - " + c["against"].split("/", 1)[1], Interval(**c[key]))
            for c in study["comparisons"] if c["task"] == task]
    for y, (name, iv) in enumerate(rows):
        mode, shard, *rest = name.split(" - ")[0].split("/")
        style = cell_style(mode, shard, not rest)
        ax.plot([iv.lo, iv.hi], [y, y], color=style["color"], ls=style["ls"], lw=2)
        ax.plot([iv.mean], [y], "o", color=style["color"])
    ax.axvline(0.0, color="0.3", lw=0.8)
    ax.set_yticks(range(len(rows)), [name for name, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel(f"difference in {key.replace('_', ' ')} (paired by seed, 95% CI)")
    ax.set_title(f"{task}: minus token, paired by seed")
    return rows


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
            plot_effects(ax, study, task, key)
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
