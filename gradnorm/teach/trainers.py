"""Notebook 07: who gets how much of a real trainer's step, read from the trainer audit's weights.

The trainer audit (``gradnorm.audit.trainer``) trains a real trainer on its probe and returns, for
one process and for each (W, A), the weight w[i, t] that one optimizer step gave every token, the
plan that sent row i to rank r and microbatch m, and the mask M of the tokens a loss should count.
This module reads those three arrays (tensors or arrays, so it needs nothing from
``gradnorm.audit``, which sits above the teaching layer) and answers notebook 01's questions of
them:

- how large the whole step is: the total weight Σ w over the counted tokens, 1 for the token mean
  of one process, and its ratio to that one-process step (``StepSize``);
- what each token weighs in units of the token mean, w x N, drawn as notebook 01 draws it: one bar
  per token, width 1/N and height w x N, so that a bar's area is the token's weight and the bars'
  total area is the step's total weight (``token_bars``, ``plot_token_weights``);
- the weights of the classic bug written out longhand, each microbatch's own mean,
  w = 1/N[r, m] (``microbatch_mean_weights``), for the notebook to compare with what it measured.

Each rank's share of the update beside its share of the tokens is ``gradnorm.audit.plot``'s
``plot_rank_shares``; nothing here touches pyplot or torch.distributed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.container import BarContainer
from matplotlib.patches import Patch

from gradnorm.teach.palette import MODE_COLORS, rank_color

Plan = Sequence[Sequence[Sequence[int]]]  # plan[rank][microbatch] = the row indices it holds
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "trainers"  # the repository's build functions


def example_build(spec: str) -> str:
    """``"hf_trainer.py:build"`` -> the absolute ``file.py:function`` the trainer audit takes, from any folder.

    A notebook runs in notebooks/, the command in the repository's root: the path is resolved here so
    that both find the same file.
    """
    file, _, function = spec.partition(":")
    path = EXAMPLES / file
    if not path.is_file() or not function:
        raise ValueError(f"{spec!r}: expected 'file.py:function' with a file in {EXAMPLES}")
    return f"{path}:{function}"


def _array(x, dtype=None) -> np.ndarray:
    return np.asarray(x.detach().cpu() if hasattr(x, "detach") else x, dtype=dtype)


def plan_order(plan: Plan) -> list[tuple[int, int, int]]:
    """(row, rank, microbatch) of every row, rank 0's first microbatch first."""
    return [(int(i), r, m) for r, rank in enumerate(plan) for m, mb in enumerate(rank) for i in _array(mb, int)]


@dataclass(frozen=True)
class StepSize:
    """How much weight one optimizer step hands out, against the one-process step."""

    total: float  # Σ w[i, t] over the counted tokens (M)
    reference_total: float  # the same sum for one process with one microbatch
    world_size: int
    accum_steps: int

    @property
    def scale(self) -> float:
        """total / reference_total: 1 for an invariant step, W·A when every microbatch is its own mean."""
        return self.total / self.reference_total


def step_size(weights, reference_weights, mask, world_size: int, accum_steps: int) -> StepSize:
    m = _array(mask, bool)
    return StepSize(float(_array(weights, float)[m].sum()), float(_array(reference_weights, float)[m].sum()),
                    world_size, accum_steps)


def microbatch_mean_weights(mask, plan: Plan) -> np.ndarray:
    """(rows, T) w[i, t] = 1/N[r, m] on the counted tokens of row i's microbatch (r, m), 0 elsewhere.

    What a step gives when every microbatch's loss is that microbatch's own mean, summed over the A
    microbatches (nothing divides by A) and averaged over the W ranks after being multiplied by W
    (DDP's mean undone). Each of the W·A microbatches then carries a total weight of 1, so the step
    totals W·A where one process's token mean totals 1.
    """
    m = _array(mask, bool)
    w = np.zeros(m.shape)
    for rank in plan:
        for mb in rank:
            rows = _array(mb, int)
            w[rows] = m[rows] / m[rows].sum()  # 1/N[r, m] on this microbatch's counted tokens
    return w


@dataclass(frozen=True)
class TokenBars:
    """One bar per counted token, in plan order: left edge, width 1/N, height w x N, and its place."""

    left: np.ndarray  # (N,)
    width: float  # 1/N
    height: np.ndarray  # (N,) w x N: 1 is the token mean
    rank: np.ndarray  # (N,)
    microbatch: np.ndarray  # (N,)

    @property
    def area(self) -> float:
        """Σ width x height = Σ w: the step's total weight."""
        return float(self.width * self.height.sum())


def token_bars(weights, mask, plan: Plan) -> TokenBars:
    """The bars of ``plot_token_weights``: every counted token of every row, rank by rank, microbatch by microbatch."""
    w, m = _array(weights, float), _array(mask, bool)
    num_tokens = int(m.sum())  # N
    height, rank, microbatch = [], [], []
    for row, r, mb in plan_order(plan):
        kept = w[row][m[row]] * num_tokens  # (tokens of this row,) w x N
        height.append(kept)
        rank.append(np.full(len(kept), r))
        microbatch.append(np.full(len(kept), mb))
    height = np.concatenate(height)
    if len(height) != num_tokens:
        raise ValueError(f"the plan holds {len(height)} counted tokens, the mask {num_tokens}: "
                         "a row is missing or repeated")
    return TokenBars(np.arange(num_tokens) / num_tokens, 1.0 / num_tokens, height, np.concatenate(rank),
                     np.concatenate(microbatch))


def plot_token_weights(ax: Axes, weights, mask, plan: Plan, title: str, ymax: float | None = None) -> BarContainer:
    """Notebook 01's picture of measured weights: a bar per token, width 1/N, height w x N, colour its rank.

    The dashed line at 1 is the token mean (``token``'s colour); solid lines separate ranks and dotted
    lines microbatches. A bar's area is the token's weight, so the bars' total area is the step's
    total weight: 1 for the one-process token mean.
    """
    bars = token_bars(weights, mask, plan)
    drawn = ax.bar(bars.left, bars.height, width=bars.width, align="edge", linewidth=0,
                   color=[rank_color(int(r)) for r in bars.rank])
    mean = ax.axhline(1.0, color=MODE_COLORS["token"], lw=1.5, ls="--", label="1/N, the token mean")
    for k in range(1, len(bars.left)):
        if bars.rank[k] != bars.rank[k - 1]:
            ax.axvline(bars.left[k], color="black", lw=1.2)
        elif bars.microbatch[k] != bars.microbatch[k - 1]:
            ax.axvline(bars.left[k], color="black", lw=0.8, ls=":")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, ymax if ymax is not None else 1.1 * max(1.0, float(bars.height.max())))
    ax.set_xlabel("share of the step's counted tokens (rank by rank, microbatch by microbatch)")
    ax.set_ylabel("w × N (1 = the token mean)")
    ax.set_title(f"{title}\ntotal weight (bar area) {bars.area:.3g}", fontsize="medium")
    ranks = [Patch(color=rank_color(r), label=f"rank {r}") for r in sorted(set(bars.rank.tolist()))]
    ax.legend(handles=[mean, *ranks], loc="upper right", fontsize="small")
    return drawn
