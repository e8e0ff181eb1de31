"""Drawing share sweeps and gradient sweeps on matplotlib Axes the caller owns.

Notebooks 01, 02 and 05: the data of ``gradnorm.teach.imbalance`` and ``gradnorm.teach.sweeps``
(notebook 03 draws the controlled study with ``gradnorm.teach.study``). The explorers' pictures (01, 02, 04), built once and updated in place, are in
``gradnorm.teach.views``; the length-bias views of notebook 04 in ``gradnorm.teach.lengthplots``. Colours,
markers and line styles come from ``gradnorm.teach.palette`` (re-exported here), the one palette.

Every function takes an ``Axes``, draws, and returns the artists it made, so tests can read bar
heights and line data instead of pixels. Nothing here touches pyplot's global state.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.container import BarContainer
from matplotlib.lines import Line2D

from gradnorm.teach.imbalance import ShareSweep
from gradnorm.teach.palette import (  # noqa: F401  (re-exported: the palette's names, where drawing code looks)
    MODE_COLORS, MODE_MARKERS, RANK_COLORS, SHARD_STYLES, TOKENS_COLOR, mode_label, mode_style, rank_color,
)
from gradnorm.teach.sweeps import GradientSweep
from gradnorm.teach.views import LOG_FLOOR, X_LABEL, nice_ceiling, on_log_axis

# ---------------------------------------------------------------------------------------------
# 1. Token imbalance
# ---------------------------------------------------------------------------------------------


def plot_share_sweep(ax: Axes, sweep: ShareSweep) -> dict[str, Line2D]:
    """Rank 0's share of the update under each mode, and of the tokens, against the imbalance."""
    out = {"tokens": ax.plot(sweep.imbalance, sweep.token_share, color=TOKENS_COLOR, lw=4, alpha=0.6,
                             label="rank 0's share of the tokens")[0]}
    for mode, share in sweep.update_share.items():
        out[mode] = ax.plot(sweep.imbalance, share, color=MODE_COLORS[mode], marker=MODE_MARKERS[mode], ms=4,
                            label=f"rank 0's share of the update: {mode}")[0]
    ax.set_xlabel("imbalance: tokens of a response in a full microbatch / in the short one")
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


def plot_gradient_sweep(
    ax_error: Axes, ax_cosine: Axes, sweep: GradientSweep, modes: Sequence[str] | None = None,
) -> dict[str, tuple[Line2D, Line2D]]:
    """Relative error and 1 - cosine against the full-batch gradient, per mode, on log axes.

    A log axis holds the bug (errors of 1e-2 to 1) and rounding (1e-16) at once; values below
    ``views.LOG_FLOOR`` (0 included) are drawn at the floor, and the top rises above 2 only to
    hold a larger value. The exact modes coincide at the
    rounding level, so each has its own marker, of decreasing size, drawn as concentric rings.
    Returns {mode: (error line, 1 - cosine line)}.
    """
    modes = list(sweep.relative_error) if modes is None else list(modes)
    # The top stays at 2 (errors of order 1) unless a value passes it: nothing is drawn off the axis.
    largest = max(float(np.max(np.concatenate(on_log_axis(sweep, mode)))) for mode in modes)
    top = max(2.0, nice_ceiling(1.2 * largest))
    out = {}
    for mode in modes:
        # "token (DAPO)" names a GRPO paper: on an SFT or DPO loss the mode's own name says it all
        style = {**mode_style(mode), "label": mode_label(mode) if sweep.loss == "grpo" else mode}
        error, one_minus_cos = on_log_axis(sweep, mode)
        out[mode] = (ax_error.plot(sweep.x, error, **style)[0],
                     ax_cosine.plot(sweep.x, one_minus_cos, **style)[0])
    where = f"{sweep.world_size} ranks x {sweep.accum_steps} microbatches, {sweep.shard} sharding"
    ax_error.set_title(f"relative error vs the full batch\n({where})", fontsize="medium")
    ax_error.set_ylabel("|g - g_full| / |g_full|")
    ax_cosine.set_title(f"1 - cosine with the full batch\n({where})", fontsize="medium")
    ax_cosine.set_ylabel("1 - cos(g, g_full)")
    for ax in (ax_error, ax_cosine):
        ax.set_xlabel(X_LABEL[sweep.unit])
        ax.set_yscale("log")
        ax.set_ylim(LOG_FLOOR / 2, top)
    ax_error.legend(fontsize="small", loc="center right")
    return out


def plot_gradient_error_linear(ax: Axes, sweep: GradientSweep, mode: str = "local") -> dict[str, Line2D]:
    """One mode's relative error and 1 - cosine against the full batch on a linear axis.

    The log axes of ``plot_gradient_sweep`` hold the bug and rounding at once; an error that grows
    from 0.1 to 3 sits in their top decade, so this panel shows how it grows.
    """
    style = mode_style(mode)
    out = {"error": ax.plot(sweep.x, sweep.relative_error[mode], **style, label="|g - g_full| / |g_full|")[0],
           "1 - cosine": ax.plot(sweep.x, 1 - sweep.cosine[mode], **{**style, "ls": ":", "mfc": "none"},
                                 label="1 - cos(g, g_full)")[0]}
    ax.set_title(f"{mode}: error vs the full batch, linear axis", fontsize="medium")
    ax.set_xlabel(X_LABEL[sweep.unit])
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small", loc="upper left")
    return out


def plot_sharding_comparison(
    ax: Axes, sweeps: dict[str, GradientSweep], mode: str = "local"
) -> dict[str, Line2D]:
    """One mode's relative error against the spread k, one line per sharding."""
    out = {}
    for shard, sweep in sweeps.items():
        out[shard] = ax.plot(sweep.x, sweep.relative_error[mode], ms=4, color=MODE_COLORS[mode],
                             label=shard, **SHARD_STYLES[shard])[0]
    ax.set_title(f"{mode}: relative error under each sharding", fontsize="medium")
    ax.set_xlabel(X_LABEL[next(iter(sweeps.values())).unit])
    ax.set_ylabel("|g - g_full| / |g_full|")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small", title="sharding", title_fontsize="small")
    return out


def mark_microbatches(ax: Axes, rank: Sequence[int], microbatch: Sequence[int], rows: int) -> list[int]:
    """On a weight map whose rows are sequences in plan order (``rank`` and ``microbatch`` of each
    row, e.g. ``gradnorm.audit.plot.plan_rows``): over its first ``rows`` rows, a dashed line
    between microbatches and each microbatch's name ("r0/m1") inside the right edge (the
    caller's y axis spans exactly those rows, top to bottom).

    The map's own dotted lines vanish at 64 rows; a zoom on a few rows needs them drawn boldly to
    tell microbatches apart. Returns the rows where a new microbatch starts (0 included)."""
    starts = [0] + [j for j in range(1, rows) if (rank[j], microbatch[j]) != (rank[j - 1], microbatch[j - 1])]
    for j in starts[1:]:
        ax.axhline(j - 0.5, color="black", lw=1.6, ls="--")
    for a, b in zip(starts, starts[1:] + [rows]):
        ax.text(0.98, 1 - (a + b) / (2 * rows), f"r{rank[a]}/m{microbatch[a]}", transform=ax.transAxes,
                va="center", ha="right", fontsize=8, bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
    return starts
