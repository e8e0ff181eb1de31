"""Drawing token imbalance, gradient sweeps and training runs on matplotlib Axes the caller owns.

Notebooks 01, 02, 03 and 05: the data of ``gradnorm.imbalance``, ``gradnorm.sweeps`` and
``gradnorm.runs``. The length-bias views of notebook 04 are in ``gradnorm.lengthplots``, which
shares the colours and labels defined here.

Every function takes an ``Axes`` (or a ``Figure`` for the multi-panel views), draws, and returns
the artists it made, so tests can read bar heights and line data instead of pixels. Nothing here
touches pyplot's global state: notebooks pass axes from ``plt.subplots``, the widgets and the
figure script pass a ``matplotlib.figure.Figure`` of their own.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.container import BarContainer
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from gradnorm.imbalance import Layout, Minibatch, RankShares, ShareSweep, batch_rank_shares, token_layout
from gradnorm.modes import PAPER_OF_MODE
from gradnorm.runs import TrainingRun, moving_average
from gradnorm.sweeps import GradientSweep

MODE_COLORS = {"local": "#d62728", "token": "#1f77b4", "sequence": "#ff7f0e", "group": "#2ca02c",
               "constant": "#9467bd", "global": "#1f77b4"}  # global: DPO's mean over all pairs
TOKENS_COLOR = "#9a9a9a"
RANK_COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c"]


def mode_label(mode: str) -> str:
    """'sequence (DeepSeekMath GRPO)': the mode and who uses it."""
    return f"{mode} ({PAPER_OF_MODE[mode]})" if mode in ("sequence", "token", "constant") else mode


def rank_color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


# ---------------------------------------------------------------------------------------------
# 1. Token imbalance
# ---------------------------------------------------------------------------------------------


def plot_token_weights(
    ax: Axes, layout: Layout, title: str | None = None, ymax: float | None = None
) -> BarContainer:
    """One bar per sequence: width |o_i| tokens, height the weight w of each of its tokens.

    The bar's area is the sequence's weight in J; colours are ranks; dotted lines separate
    microbatches. Returns the bars in plan order (``layout.sequence`` gives each one's index).
    """
    colors = [rank_color(r) for r in layout.rank]
    # White edges show the responses of a small minibatch; among thousands of tokens an edge in the
    # face colour instead keeps a bar of one or two tokens visible.
    edges = "white" if len(layout.rank) <= 32 else colors
    bars = ax.bar(layout.left, layout.weight, width=layout.length, align="edge", color=colors, edgecolor=edges,
                  linewidth=0.8)
    ends = layout.left + layout.length
    few_microbatches = len(set(zip(layout.rank.tolist(), layout.microbatch.tolist()))) <= 16
    for j in range(1, len(layout.rank)):  # a solid line between ranks, a dotted one between microbatches
        if layout.rank[j] != layout.rank[j - 1]:
            ax.axvline(layout.left[j], color="black", lw=1.2)
        elif few_microbatches and layout.microbatch[j] != layout.microbatch[j - 1]:
            ax.axvline(layout.left[j], color="black", lw=0.8, ls=":")
    total = max(int(ends.max()), 1)
    ax.set_xlim(-0.01 * total, total)  # a margin so that a one-token bar at 0 is not hidden by the spine
    if ymax is not None:
        ax.set_ylim(0, ymax)
    ax.set_xlabel("response tokens, rank by rank, microbatch by microbatch")
    ax.set_ylabel("weight w of one token in J")
    if title:
        ax.set_title(title)
    return bars


def plot_rank_shares(ax: Axes, shares: dict[str, RankShares]) -> dict[str, BarContainer]:
    """Per rank: its share of the tokens (grey) next to its share of the update under each mode.

    Returns {"tokens": bars, mode: bars, ...}, one bar per rank in each.
    """
    modes = list(shares)
    world_size = len(next(iter(shares.values())).tokens)
    width = 0.8 / (len(modes) + 1)
    x = np.arange(world_size)
    out = {"tokens": ax.bar(x, shares[modes[0]].tokens, width, color=TOKENS_COLOR, label="share of the tokens")}
    for k, mode in enumerate(modes, start=1):
        out[mode] = ax.bar(x + k * width, shares[mode].update, width, color=MODE_COLORS.get(mode, "C0"),
                           label=f"share of the update: {mode}")
    ax.axhline(1 / world_size, color="black", lw=0.6, ls=":")
    ax.set_xticks(x + width * len(modes) / 2, [f"rank {r}" if world_size <= 4 else str(r) for r in range(world_size)])
    ax.set_ylabel("share")
    ax.set_ylim(0, max(b.get_height() for c in out.values() for b in c) * 1.6)  # room for the legend
    ax.legend(fontsize="small", loc="upper left")
    return out


def imbalance_view(
    fig: Figure, batch: Minibatch, modes: Sequence[str] = ("local", "token"), tight: bool = True
) -> dict:
    """The whole picture of notebook 01 on ``fig``: per-token weights under each mode, rank shares.

    Returns {"layout": {mode: Layout}, "weights": {mode: bars}, "shares": {mode: RankShares},
    "share_bars": {...}} for tests and readouts.
    """
    axes = fig.subplots(1, len(modes) + 1, gridspec_kw={"width_ratios": [1.4] * len(modes) + [1]})
    layouts = {m: token_layout(batch, m) for m in modes}
    ymax = 1.1 * max(float(lay.weight.max()) for lay in layouts.values())
    weights = {}
    for ax, m in zip(axes, modes):
        weights[m] = plot_token_weights(ax, layouts[m], title=f"{m}: weight of each token", ymax=ymax)
    shares = {m: batch_rank_shares(batch, m) for m in modes}
    share_bars = plot_rank_shares(axes[-1], shares)
    axes[-1].set_title("each rank's share")
    if tight:  # a full text-layout pass; widgets compute it once and reuse it (widgets.Explorer)
        fig.tight_layout()
    return {"layout": layouts, "weights": weights, "shares": shares, "share_bars": share_bars}


def plot_share_sweep(ax: Axes, sweep: ShareSweep) -> dict[str, Line2D]:
    """Rank 0's share of the update under each mode, and of the tokens, against the imbalance."""
    out = {"tokens": ax.plot(sweep.imbalance, sweep.token_share, color=TOKENS_COLOR, lw=4, alpha=0.6,
                             label="rank 0's share of the tokens")[0]}
    for mode, share in sweep.update_share.items():
        out[mode] = ax.plot(sweep.imbalance, share, color=MODE_COLORS[mode], marker="o", ms=3,
                            label=f"rank 0's share of the update: {mode}")[0]
    ax.set_xlabel("imbalance: tokens of a full microbatch / tokens of the short one")
    ax.set_ylabel("share")
    ax.set_ylim(0, 1)
    ax.legend(fontsize="small")
    return out


# ---------------------------------------------------------------------------------------------
# 2. Real gradients
# ---------------------------------------------------------------------------------------------


def plot_microbatch_tokens(
    ax: Axes, tokens: np.ndarray, title: str | None = None, unit: str = "tokens"
) -> BarContainer:
    """N[r, m] (W, A) as bars, one per microbatch, coloured by rank (``unit``: what is counted)."""
    world_size, accum_steps = tokens.shape
    labels = [f"r{r}/m{m}" for r in range(world_size) for m in range(accum_steps)]
    colors = [rank_color(r) for r in range(world_size) for _ in range(accum_steps)]
    bars = ax.bar(labels, tokens.reshape(-1), color=colors)
    ax.set_ylabel("response tokens" if unit == "tokens" else unit)
    ax.set_xlabel("rank / microbatch")
    if title:
        ax.set_title(title)
    return bars


IMBALANCE_LABEL = {"tokens": "imbalance: longest / shortest response",
                   "pairs": "imbalance: pairs in a full microbatch / in the long-pair one"}


def plot_gradient_sweep(
    ax_error: Axes, ax_cosine: Axes, sweep: GradientSweep, modes: Sequence[str] | None = None,
    marker_at: float | None = None,
) -> dict[str, tuple[Line2D, Line2D]]:
    """Relative error and cosine similarity against the full-batch gradient, per mode.

    Returns {mode: (error line, cosine line)}. ``marker_at`` marks one imbalance with a dot.
    """
    modes = list(sweep.relative_error) if modes is None else list(modes)
    out = {}
    for mode in modes:
        style = {"color": MODE_COLORS[mode], "marker": "o", "ms": 3, "label": mode_label(mode)}
        if mode != "local":
            style["ls"] = "--"
        out[mode] = (ax_error.plot(sweep.imbalance, sweep.relative_error[mode], **style)[0],
                     ax_cosine.plot(sweep.imbalance, sweep.cosine[mode], **style)[0])
        if marker_at is not None:
            k = int(np.argmin(np.abs(sweep.imbalance - marker_at)))
            ax_error.plot([sweep.imbalance[k]], [sweep.relative_error[mode][k]], "o", color=MODE_COLORS[mode], ms=9)
            ax_cosine.plot([sweep.imbalance[k]], [sweep.cosine[mode][k]], "o", color=MODE_COLORS[mode], ms=9)
    where = f"{sweep.world_size} ranks x {sweep.accum_steps} microbatches, {sweep.shard} sharding"
    ax_error.set_title(f"relative error vs the full batch\n({where})", fontsize="medium")
    ax_error.set_ylabel("|g - g_full| / |g_full|")
    ax_cosine.set_title(f"cosine similarity with the full batch\n({where})", fontsize="medium")
    ax_cosine.set_ylabel("cos(g, g_full)")
    for ax in (ax_error, ax_cosine):
        ax.set_xlabel(IMBALANCE_LABEL[sweep.unit])
    ax_error.set_ylim(bottom=0)
    ax_cosine.set_ylim(min(0.8, float(min(sweep.cosine[m].min() for m in modes)) - 0.02), 1.01)
    ax_error.legend(fontsize="small")
    return out


def plot_sharding_comparison(
    ax: Axes, sweeps: dict[str, GradientSweep], mode: str = "local"
) -> dict[str, Line2D]:
    """One mode's relative error against the imbalance, one line per sharding."""
    out = {}
    for k, (shard, sweep) in enumerate(sweeps.items()):
        out[shard] = ax.plot(sweep.imbalance, sweep.relative_error[mode], marker="o", ms=3, color=f"C{k}",
                             label=f"{shard}")[0]
    ax.set_title(f"{mode}: relative error under each sharding", fontsize="medium")
    ax.set_xlabel("imbalance: longest / shortest response")
    ax.set_ylabel("|g - g_full| / |g_full|")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small", title="sharding", title_fontsize="small")
    return out


def gradient_view(
    fig: Figure, sweep: GradientSweep, mode: str, imbalance: float, tight: bool = True
) -> dict:
    """Notebook 02's explorer: microbatch tokens at one imbalance, one mode's error and cosine."""
    ax_tokens, ax_error, ax_cosine = fig.subplots(1, 3)
    k = int(np.argmin(np.abs(sweep.imbalance - imbalance)))
    bars = plot_microbatch_tokens(ax_tokens, sweep.microbatch_tokens[k], unit=sweep.unit,
                                  title=f"{sweep.unit} per microbatch at imbalance {sweep.imbalance[k]:g}")
    lines = plot_gradient_sweep(ax_error, ax_cosine, sweep, [mode], marker_at=sweep.imbalance[k])
    if tight:  # a full text-layout pass; widgets compute it once and reuse it (widgets.Explorer)
        fig.tight_layout()
    return {"tokens": bars, "lines": lines, "index": k}


# ---------------------------------------------------------------------------------------------
# 3. Training runs
# ---------------------------------------------------------------------------------------------

TRAINING_PANELS = {"reward_mean": "mean reward", "response_len_mean": "mean response length (tokens)",
                   "grad_norm": "gradient norm (before clipping)"}
SHARD_STYLES = {"length": "-", "balanced": "--", "interleave": ":", "contiguous": "-."}


def plot_training_runs(
    axes: Sequence[Axes], runs: Sequence[TrainingRun], keys: Sequence[str] = tuple(TRAINING_PANELS),
    window: int = 10,
) -> dict[str, list[Line2D]]:
    """One panel per logged metric: each run's raw values (thin) and trailing average (thick).

    Colour is the denominator, line style the sharding. Returns {run label: [average line per panel]}.
    """
    out = {}
    for run in runs:
        color = MODE_COLORS.get(run.loss_denominator, "C7")
        style = SHARD_STYLES.get(run.shard, "-")
        out[run.label] = []
        for ax, key in zip(axes, keys):
            ax.plot(run.steps, run.series(key), color=color, ls=style, lw=0.7, alpha=0.3)
            out[run.label].append(ax.plot(run.steps, moving_average(run.series(key), window), color=color,
                                          ls=style, lw=2, label=run.label)[0])
    for ax, key in zip(axes, keys):
        ax.set_title(TRAINING_PANELS.get(key, key), fontsize="medium")
        ax.set_xlabel("optimizer step")
    axes[0].legend(fontsize="small")
    return out


def plot_rank_token_share(ax: Axes, runs: Sequence[TrainingRun], world_size: int, window: int = 10) -> dict:
    """Rank 0's share of each step's tokens, next to the 1/W share of the update ``local`` gives it."""
    out = {}
    for run in runs:
        share = run.rank_token_share(0)
        out[run.label] = ax.plot(run.steps, moving_average(share, window), ls=SHARD_STYLES.get(run.shard, "-"),
                                 color=TOKENS_COLOR, lw=2, label=f"rank 0's share of the tokens ({run.shard})")[0]
    out["local"] = ax.axhline(1 / world_size, color=MODE_COLORS["local"], lw=2,
                              label="rank 0's share of the update under local")
    ax.set_ylim(0, 1)
    ax.set_xlabel("optimizer step")
    ax.set_title("rank 0: tokens held vs update received", fontsize="medium")
    ax.legend(fontsize="small")
    return out
