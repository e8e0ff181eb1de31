"""The explorers' pictures, built once and updated in place (notebooks 01, 02 and 04).

Each view makes all its artists when it is built, on a ``Figure`` the caller owns, and its
``update`` moves them (bar bounds, line data, axis limits) instead of drawing a new figure, so a
slider callback costs a few bars, not a figure (``gradnorm.teach.canvas``). ``dynamic`` lists what
changes between updates, in drawing order: the data artists, the spines over them, and every
axis whose limits follow the data; everything else (titles, labels, legends) never changes.
The same views draw the static figures of the notebooks and of ``figures/make_figures.py``.

``update`` returns its artists and data, so tests read bar heights and line data, not pixels.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.artist import Artist
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from gradnorm.teach.imbalance import ShardedBatch, layout_and_shares
from gradnorm.teach.lengthbias import CorrectVsWrong
from gradnorm.teach.palette import MODE_COLORS, NEUTRAL_COLOR, TOKENS_COLOR, mode_style, rank_color
from gradnorm.teach.sweeps import GradientSweep

X_LABEL = {"tokens": "spread k (every length within 12/k to 12 tokens)",
                   "pairs": "pair ratio: pairs in a full microbatch / in the long-pair one"}


# What a bar of ImbalanceView stands for, per objective: (unit, units, units in full, their count, the weight).
UNITS = {"grpo": ("token", "tokens", "response tokens", "N", "w"),
         "sft": ("label token", "label tokens", "label tokens", "N", "w"),
         "dpo": ("pair", "pairs", "pairs", "P", "v")}

LOG_FLOOR = 1e-18  # the bottom of the log-scale error axes: a value of 0 (or below) is drawn there
COSINE_FLOOR = 1e-15  # 1 - cos below this is float64 rounding (exact 0 or ~1e-16 alike): drawn at this floor
NICE = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0)


def nice_ceiling(x: float) -> float:
    """The smallest of 1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8 times a power of ten that is >= x.

    Axis limits on this ladder take few distinct values as a slider moves, so the canvas draws
    each axis state once and pastes it afterwards (``gradnorm.teach.canvas``).
    """
    if x <= 0:
        return 1.0
    scale = 10.0 ** np.floor(np.log10(x))
    return float(scale * next(m for m in NICE if m * scale >= x * (1 - 1e-12)))


def _spines(ax) -> list[Artist]:
    return list(ax.spines.values())


class ImbalanceView:
    """Notebook 01: the weight of every token under one mode, against the token mean, and each rank's share.

    Left: one bar per response, laid out rank by rank and microbatch by microbatch; its width is
    its share of the minibatch's tokens, its height w x N (a token's weight in units of the token
    mean 1/N), so its area is its share of the update; the dashed line at 1 is ``reference``. A note
    beside rank 0's first microbatch gives its shares of the tokens and of the update, which a thin
    bar hides. ``ymax`` fixes the height axis (an explorer: frames stay comparable); without it the
    axis follows the data (one static figure).
    Right: each rank's share of the tokens next to its share of the update under both modes.
    ``objective="sft"`` draws label tokens under the SFT weights, ``"dpo"`` one bar per preference
    pair under the pair weights (``imbalance.layout_and_shares``), labelled in their units.
    """

    def __init__(self, fig: Figure, max_sequences: int = 128, max_ranks: int = 8, mode: str = "local",
                 reference: str = "token", ymax: float | None = None, objective: str = "grpo"):
        self.mode, self.reference, self.ymax, self.objective = mode, reference, ymax, objective
        unit, units, in_full, count, w = UNITS[objective]
        self.ax_w, self.ax_s = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.3, 1]})
        ax = self.ax_w
        self.bars = list(ax.bar(np.zeros(max_sequences), np.zeros(max_sequences), width=0.0, align="edge",
                                linewidth=0.8))
        self.line = ax.axhline(1.0, color=MODE_COLORS[reference], lw=1.8, ls="--",
                               label=f"{reference}: every {unit} weighs 1/{count} ({w} × {count} = 1)")
        self.rank_lines = ax.add_collection(LineCollection([], colors="black", linewidths=1.2,
                                                           transform=ax.get_xaxis_transform()), autolim=False)
        self.mb_lines = ax.add_collection(LineCollection([], colors="black", linewidths=0.8, linestyles=":",
                                                         transform=ax.get_xaxis_transform()), autolim=False)
        self.note = ax.text(0.0, 0.0, "", fontsize="small", va="bottom", color=MODE_COLORS[mode])
        ax.set_xlim(-0.006, 1.0)
        if ymax is not None:
            ax.set_ylim(0, ymax)
        ax.set_xlabel(f"share of the minibatch's {in_full} (rank by rank, microbatch by microbatch)")
        ax.set_ylabel(f"{w} × {count}: a {unit}'s weight in units of 1/{count}")
        ax.set_title(f"{mode}: weight of each {unit} (bar colour: rank; area: share of the update)",
                     loc="left", fontsize="medium")
        ax.legend(handles=[self.line], loc="lower right", bbox_to_anchor=(1.0, 1.07), frameon=False,
                  fontsize="small", borderaxespad=0)

        ax = self.ax_s
        width = 0.8 / 3
        x = np.arange(max_ranks)
        self.share_bars = {
            "tokens": list(ax.bar(x, np.zeros(max_ranks), width, color=TOKENS_COLOR, label=f"share of the {units}")),
            mode: list(ax.bar(x + width, np.zeros(max_ranks), width, color=MODE_COLORS[mode],
                              label=f"share of the update: {mode}")),
            reference: list(ax.bar(x + 2 * width, np.zeros(max_ranks), width, color=MODE_COLORS[reference],
                                   label=f"share of the update: {reference}")),
        }
        self.fair = ax.axhline(0.5, color="black", lw=0.8, ls=":")
        ax.set_ylim(0, 1)
        ax.set_ylabel("share")
        ax.set_title("each rank's share", loc="left", fontsize="medium")
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small", borderaxespad=0)
        self.dynamic: list[Artist] = [*self.bars, self.rank_lines, self.mb_lines, self.line, self.note,
                                      *_spines(self.ax_w), *([self.ax_w.yaxis] if ymax is None else []), *[b for bars in self.share_bars.values() for b in bars],
                                      self.fair, *_spines(self.ax_s), self.ax_s.xaxis]

    def update(self, batch: ShardedBatch) -> dict:
        modes = (self.mode, self.reference)
        both = {m: layout_and_shares(batch, m, self.objective) for m in modes}
        layouts = {m: layout for m, (layout, _) in both.items()}
        shares = {m: share for m, (_, share) in both.items()}
        lay = layouts[self.mode]
        n = max(float(lay.length.sum()), 1.0)
        count = len(lay.length)
        if count > len(self.bars):
            raise ValueError(f"the view was built for {len(self.bars)} responses, got {count}")
        edge = "white" if count <= 32 else None  # among many thin bars an edge in the face colour keeps each visible
        for k, rect in enumerate(self.bars):
            rect.set_visible(k < count)
            if k < count:
                color = rank_color(int(lay.rank[k]))
                rect.set_bounds(lay.left[k] / n, 0.0, lay.length[k] / n, lay.weight[k] * n)
                rect.set_facecolor(color)
                rect.set_edgecolor(edge or color)
        starts = lay.left / n
        new_rank = np.flatnonzero(np.diff(lay.rank) != 0) + 1
        new_mb = np.flatnonzero((np.diff(lay.rank) == 0) & (np.diff(lay.microbatch) != 0)) + 1
        if batch.world_size * batch.accum_steps > 16:  # too many dotted lines hide the bars
            new_mb = new_mb[:0]
        self.rank_lines.set_segments([[(starts[j], 0), (starts[j], 1)] for j in new_rank])
        self.mb_lines.set_segments([[(starts[j], 0), (starts[j], 1)] for j in new_mb])
        top = self.ymax or nice_ceiling(1.1 * max(float((lay.weight * n).max(initial=0.0)), 1.0))
        if self.ymax is None:
            self.ax_w.set_ylim(0, top)
        first = (lay.rank == 0) & (lay.microbatch == 0)  # rank 0's first microbatch
        first_tokens = float(lay.length[first].sum()) / n
        first_update = float((lay.weight[first] * lay.length[first]).sum())
        height = float(lay.weight[first].max(initial=0.0)) * n
        self.note.set_position((0.0, min(height + 0.03 * top, 0.9 * top)))
        units = UNITS[self.objective][1]
        self.note.set_text(f"\u2199 rank 0's first microbatch: {first_tokens:.1%} of the {units}, "
                           f"{first_update:.1%} of the update")

        world_size = len(shares[self.mode].tokens)
        values = {"tokens": shares[self.mode].tokens, self.mode: shares[self.mode].update,
                  self.reference: shares[self.reference].update}
        for key, bars in self.share_bars.items():
            for r, rect in enumerate(bars):
                rect.set_visible(r < world_size)
                if r < world_size:
                    rect.set_height(values[key][r])
        self.fair.set_ydata([1 / world_size] * 2)
        self.ax_s.set_xlim(-0.35, world_size - 0.35)
        self.ax_s.set_xticks(np.arange(world_size) + 0.8 / 3,
                             [f"rank {r}" if world_size <= 4 else str(r) for r in range(world_size)])
        return {"layout": layouts, "shares": shares, "weights": {self.mode: self.bars[:count]}, "note": self.note,
                "line": self.line, "share_bars": {k: bars[:world_size] for k, bars in self.share_bars.items()}}


def imbalance_figure(fig: Figure, batch: ShardedBatch, objective: str = "grpo", reference: str = "token") -> dict:
    """``ImbalanceView`` of one minibatch as a static figure (notebook 01's seed example; 05's SFT and DPO:
    ``objective="sft"``, or ``"dpo"`` with ``reference="pair"`` on a ``pairs_minibatch``)."""
    view = ImbalanceView(fig, max_sequences=len(batch.lengths), max_ranks=batch.world_size, reference=reference,
                         objective=objective)
    artists = view.update(batch)
    fig.tight_layout()
    return artists


class GradientView:
    """Notebook 02: microbatch token counts at one spread k, and one mode's gradient error over all of them."""

    def __init__(self, fig: Figure, spreads: Sequence[float], world_size: int, accum_steps: int,
                 unit: str = "tokens"):
        self.spreads = np.asarray(spreads, dtype=float)
        self.ax_t, self.ax_e, self.ax_c = fig.subplots(1, 3)
        ax = self.ax_t
        labels = [f"r{r}/m{m}" for r in range(world_size) for m in range(accum_steps)]
        colors = [rank_color(r) for r in range(world_size) for _ in range(accum_steps)]
        self.bars = list(ax.bar(labels, np.zeros(len(labels)), color=colors))
        self.setting = ax.text(0.03, 0.96, "", transform=ax.transAxes, va="top", fontsize="small")
        ax.set_xlabel("rank / microbatch (colour: rank)")
        ax.set_ylabel(f"{unit} per microbatch")
        ax.set_title(f"{unit} per microbatch", loc="left", fontsize="medium")
        self.lines, self.dots = [], []
        for ax, title, ylabel in ((self.ax_e, "relative error vs the full batch", "|g - g_full| / |g_full|"),
                                  (self.ax_c, "1 - cosine with the full batch", "1 - cos(g, g_full)")):
            self.lines.append(ax.plot(self.spreads, np.ones(len(self.spreads)))[0])
            self.dots.append(ax.plot([1.0], [1.0], "o", ms=10, alpha=0.5)[0])
            span = self.spreads.max() - self.spreads.min()
            ax.set_xlim(self.spreads.min() - 0.04 * span - 0.1, self.spreads.max() + 0.04 * span + 0.1)
            ax.set_yscale("log")  # rounding (1e-16) and the bug (1e-1) on one fixed axis
            ax.set_ylim(LOG_FLOOR, 2.0)
            ax.set_xlabel(X_LABEL[unit])
            ax.set_ylabel(ylabel)
            ax.set_title(title, loc="left", fontsize="medium")
        # Above the axes, right of the title: inside them a curve that jumps between the bug's level and
        # rounding's (local under balanced sharding) crosses any fixed spot.
        self.mode_text = self.ax_e.text(1.0, 1.02, "", transform=self.ax_e.transAxes, ha="right", va="bottom",
                                        fontsize="medium", fontweight="bold")
        self.dynamic: list[Artist] = [*self.bars, self.setting, *_spines(self.ax_t), self.ax_t.yaxis]
        for ax, line, dot in zip((self.ax_e, self.ax_c), self.lines, self.dots):
            self.dynamic += [line, dot, *_spines(ax)]
        self.dynamic.append(self.mode_text)

    def update(self, sweep: GradientSweep, mode: str, spread: float) -> dict:
        k = int(np.argmin(np.abs(sweep.x - spread)))
        tokens = sweep.microbatch_tokens[k].reshape(-1)
        for rect, value in zip(self.bars, tokens):
            rect.set_height(value)
        self.ax_t.set_ylim(0, nice_ceiling(1.3 * max(float(tokens.max()), 1.0)))
        self.setting.set_text(f"{sweep.shard} sharding, spread k = {sweep.x[k]:g}")
        style = mode_style(mode)
        for line, dot, y in zip(self.lines, self.dots, on_log_axis(sweep, mode)):
            line.set_data(sweep.x, y)
            line.set(color=style["color"], marker=style["marker"], ls=style["ls"], ms=4, mfc=style["color"])
            dot.set_data([sweep.x[k]], [y[k]])
            dot.set_color(style["color"])
        self.mode_text.set_text(f"mode: {mode}")
        self.mode_text.set_color(style["color"])
        return {"tokens": self.bars, "lines": {mode: tuple(self.lines)}, "index": k}


def on_log_axis(sweep: GradientSweep, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """(relative error, 1 - cosine) of one mode: the error raised to ``LOG_FLOOR`` (0 included), 1 - cosine
    to ``COSINE_FLOOR``, below which a float64 cosine only rounds."""
    return (np.maximum(sweep.relative_error[mode], LOG_FLOOR), np.maximum(1.0 - sweep.cosine[mode], COSINE_FLOOR))


def push_axis(settings: Sequence[CorrectVsWrong], modes: Sequence[str]) -> tuple[float, float]:
    """The push axis that holds every bar of every setting in ``settings``, with room under the lowest
    wrong bar for its value label."""
    low = min(0.0, *(float(v.push_per_token[m][1]) for v in settings for m in modes))
    top = nice_ceiling(1.3 * max(0.0, *(float(v.push_per_token[m][0]) for v in settings for m in modes)))
    return (-max(nice_ceiling(1.3 * -low), 0.12 * top) if low < 0 else 0.0, top)


class CorrectVsWrongView:
    """Notebook 04: the push on one correct and one wrong token per mode, and who gets the update."""

    def __init__(self, fig: Figure, modes: Sequence[str], ylim: tuple[float, float] | None = None):
        """``ylim`` fixes the push axis (stills that share it compare at a glance: ``push_axis``);
        without it the axis fits each setting."""
        self.modes, self.ylim = list(modes), ylim
        self.ax_p, self.ax_s = fig.subplots(1, 2)
        x = np.arange(len(self.modes))
        colors = [MODE_COLORS[m] for m in self.modes]
        zeros = np.zeros(len(self.modes))
        ax = self.ax_p
        self.correct = list(ax.bar(x, zeros, 0.6, color=colors))
        self.wrong = list(ax.bar(x, zeros, 0.6, color=colors, alpha=0.45, hatch="//"))
        self.zero = ax.axhline(0, color="black", lw=0.8)
        # each bar's value, so that a sliver (a wrong token with 1 correct of 8) still reads as a number
        self.label_c = [ax.text(i, 0, "", ha="center", va="bottom", fontsize="x-small") for i in x]
        self.label_w = [ax.text(i, 0, "", ha="center", va="top", fontsize="x-small") for i in x]
        ax.set_xticks(x, self.modes)
        ax.set_ylabel("push on one token: w × adv × N")
        ax.set_title("push on one token: correct (solid) up, wrong (hatched) down", loc="left", fontsize="medium")
        ax = self.ax_s
        self.share_c = list(ax.bar(x, zeros, 0.6, color=colors))
        self.share_w = list(ax.bar(x, zeros, 0.6, color=colors, alpha=0.45, hatch="//"))
        ax.set_xticks(x, self.modes)
        ax.set_ylim(0, 1)
        ax.set_ylabel("share of the update's total |push|")
        ax.set_title("who gets the update", loc="left", fontsize="medium")
        kinds = [Patch(facecolor=NEUTRAL_COLOR, label="correct responses"),
                 Patch(facecolor=NEUTRAL_COLOR, alpha=0.45, hatch="//", label="wrong responses")]
        ax.legend(handles=kinds, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small", borderaxespad=0)
        self.dynamic: list[Artist] = [*self.correct, *self.wrong, self.zero, *self.label_c, *self.label_w,
                                      *_spines(self.ax_p), self.ax_p.yaxis,
                                      *self.share_c, *self.share_w, *_spines(self.ax_s)]

    def update(self, view: CorrectVsWrong) -> dict:
        up = np.array([view.push_per_token[m][0] for m in self.modes])
        down = np.array([view.push_per_token[m][1] for m in self.modes])
        for i, (rect_c, rect_w, c, w) in enumerate(zip(self.correct, self.wrong, up, down)):
            rect_c.set_height(c)
            rect_w.set_height(w)
            self.label_c[i].set_position((i, c))
            self.label_c[i].set_text(f"{c:.3g}")
            self.label_w[i].set_position((i, w))
            self.label_w[i].set_text(f"{w:.3g}")
        self.ax_p.set_ylim(*(self.ylim or push_axis([view], self.modes)))
        for m, rect_c, rect_w in zip(self.modes, self.share_c, self.share_w):
            correct, wrong = view.update_share[m]
            rect_c.set_height(correct)
            rect_w.set_y(correct)
            rect_w.set_height(wrong)
        return {"correct": self.correct, "wrong": self.wrong, "share_correct": self.share_c,
                "share_wrong": self.share_w}
