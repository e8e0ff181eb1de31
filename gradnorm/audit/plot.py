"""Drawing an audit (``gradnorm.audit``) on matplotlib Axes that the caller owns.

Each function takes an ``Axes``, draws one ``Result`` (the weights of one configuration) and
returns its artists, so tests can read the data back instead of pixels. Colours come from
``gradnorm.teach.palette``, the notebooks' one palette; nothing here touches pyplot.
"""

from __future__ import annotations

import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import LogNorm
from matplotlib.container import BarContainer
from matplotlib.image import AxesImage

from gradnorm.audit import Result, SyntheticBatch
from gradnorm.teach.palette import (
    MODE_COLORS,
    NEUTRAL_COLOR,
    PADDING_COLOR,
    TOKENS_COLOR,
    WEIGHT_CMAP,
)


def plan_rows(result: Result) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sequence, rank, microbatch) of each row of the map: sequences in plan order."""
    rows = [(int(i), r, m) for r, rank in enumerate(result.plan) for m, mb in enumerate(rank) for i in mb]
    return tuple(np.array(col, dtype=int) for col in zip(*rows))  # type: ignore[return-value]


def weight_map(batch: SyntheticBatch, result: Result) -> np.ndarray:
    """(S, T) rows in plan order: w[i, t] * N, a token's weight in units of the token mean 1/N.

    1 everywhere is the global token mean. NaN where a token has no weight and is outside the
    mask (padding the loss rightly ignores); weight on padding (a leak) stays visible.
    """
    sequence, _, _ = plan_rows(result)
    w = result.weights[sequence].numpy() * float(batch.mask.sum())  # (S, T)
    mask = batch.mask[sequence].numpy()
    return np.where((mask & (w > 0)) | (~mask & (w != 0)), np.abs(w), np.nan)


def plot_weight_map(ax: Axes, batch: SyntheticBatch, result: Result, span: float = 16.0,
                    title: str | None = None) -> AxesImage:
    """Tokens by rank and microbatch, coloured by weight x N on a log scale (white = 1/N).

    Rows are sequences in plan order; solid lines separate ranks, dotted lines microbatches.
    ``span`` is the colour range: 1/span (blue, muted) to span (red, shouting) times 1/N.
    """
    values = weight_map(batch, result)
    _, rank, microbatch = plan_rows(result)
    image = ax.imshow(values, aspect="auto", interpolation="nearest", cmap=WEIGHT_CMAP,
                      norm=LogNorm(vmin=1 / span, vmax=span))
    ax.set_facecolor(PADDING_COLOR)
    for j in range(1, len(rank)):
        if rank[j] != rank[j - 1]:
            ax.axhline(j - 0.5, color="black", lw=1.0)
        elif microbatch[j] != microbatch[j - 1]:
            ax.axhline(j - 0.5, color="black", lw=0.4, ls=":")
    starts = [0] + [j for j in range(1, len(rank)) if rank[j] != rank[j - 1]] + [len(rank)]
    ax.set_yticks([(a + b - 1) / 2 for a, b in zip(starts, starts[1:])],
                  [f"rank {rank[a]}" for a in starts[:-1]], fontsize=7)
    ax.set_xlabel("token position t")
    ax.set_title(title or f"W={result.world_size} A={result.accum_steps} {result.label}: weight x N")
    ax.figure.colorbar(image, ax=ax, label="w[i, t] x N (1 = the token mean)")
    return image


def plot_rank_shares(ax: Axes, result: Result, title: str | None = None, mode: str | None = None
                     ) -> dict[str, BarContainer]:
    """Each rank's share of the update beside its share of the response tokens.

    ``mode``: the gradnorm mode the audited loss equals (``Report.equals``), which colours the
    update bars as every notebook colours that mode; None (no mode) draws them dark grey.
    """
    ranks = np.arange(result.world_size)
    bars = {
        "tokens": ax.bar(ranks - 0.2, result.token_share.numpy(), width=0.4, color=TOKENS_COLOR,
                         label="share of tokens"),
        "update": ax.bar(ranks + 0.2, result.update_share.numpy(), width=0.4,
                         color=MODE_COLORS.get(mode, NEUTRAL_COLOR) if mode else NEUTRAL_COLOR,
                         label=f"share of the update ({mode})" if mode else "share of the update"),
    }
    ax.set_xticks(ranks, [str(r) for r in ranks])
    ax.set_xlabel("rank")
    ax.set_ylabel("share")
    ax.set_title(title or f"W={result.world_size} A={result.accum_steps} {result.label}: who steers the update")
    ax.legend(fontsize=8)
    return bars
