"""Regenerate every figure the README and the notebooks use, deterministically.

    python figures/make_figures.py            # writes figures/*.png next to this file
    python figures/make_figures.py --out DIR  # somewhere else

Each ``figure_*`` function builds one figure from the library's data (``gradnorm.teach.imbalance``,
``sweeps``, ``lengthbias``) drawn by ``gradnorm.teach.views``, ``plotting`` and ``lengthplots`` (the
widget views through the very explorers the notebooks show, at their default settings), in the
one palette of ``gradnorm.teach.palette``, and returns
``(Figure, data)``: ``tests/notebooks/test_figures.py`` checks the data, never the pixels. Everything is
computed from fixed inputs and seeds, and the PNGs carry no timestamp or version metadata.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display needed; also keeps the PNG bytes independent of the machine

import numpy as np  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from gradnorm.teach import lengthplots, plotting, views, widgets  # noqa: E402
from gradnorm.teach.imbalance import share_sweep, worked_example_minibatch  # noqa: E402
from gradnorm.teach.lengthbias import batch_dependence, length_weights, staircase_lengths  # noqa: E402
from gradnorm.teach.sweeps import gradient_sweep  # noqa: E402

HERE = Path(__file__).resolve().parent
DPI = 100
SEED = 0
SHARE_IMBALANCES = list(widgets.IMBALANCES)  # exact ratios: the divisors of the explorer's 24 tokens
GRADIENT_SPREADS = [1, 1.5, 2, 3, 4, 5, 6, 8, 10, 12]


def figure_worked_example() -> tuple[Figure, dict]:
    """01: the seed example (2 ranks x 2 microbatches, tokens 3, 14 | 12, 12): weights and shares."""
    fig = Figure(figsize=(13, 3.8))
    artists = views.imbalance_figure(fig, worked_example_minibatch())
    return fig, {"shares": artists["shares"], "layout": artists["layout"]}


def figure_token_imbalance() -> tuple[Figure, dict]:
    """01: the imbalance explorer at its default settings (W = 2, A = 2, imbalance 4)."""
    explorer = widgets.token_imbalance_explorer()
    return explorer.figure, {"values": explorer.values, "shares": explorer.artists["shares"],
                             "layout": explorer.artists["layout"]}


def figure_share_vs_imbalance() -> tuple[Figure, dict]:
    """01: rank 0's share of the update under local and token as the short microbatch shrinks."""
    fig = Figure(figsize=(6.5, 3.8))
    sweep = share_sweep(SHARE_IMBALANCES, 2, 2, full_length=widgets.FULL_LENGTH)
    plotting.plot_share_sweep(fig.subplots(), sweep)
    fig.tight_layout()
    return fig, {"sweep": sweep}


def figure_gradient_error() -> tuple[Figure, dict]:
    """02: every mode's gradient against the full batch (length sharding), and local per sharding."""
    fig = Figure(figsize=(15, 4))
    ax_error, ax_cosine, ax_shard = fig.subplots(1, 3)
    sweeps = {shard: gradient_sweep(GRADIENT_SPREADS, shard=shard, seed=SEED)
              for shard in ("length", "contiguous", "interleave", "balanced")}  # test_figures checks this order
    plotting.plot_gradient_sweep(ax_error, ax_cosine, sweeps["length"])
    plotting.plot_sharding_comparison(ax_shard, sweeps)
    fig.tight_layout()
    return fig, {"sweeps": sweeps}


def figure_gradient_explorer() -> tuple[Figure, dict]:
    """02: the gradient explorer at its default settings (local, length sharding, spread k = 12)."""
    explorer = widgets.gradient_explorer(GRADIENT_SPREADS)
    return explorer.figure, {"values": explorer.values, "sweep": explorer.artists["sweep"]}


def figure_length_weights() -> tuple[Figure, dict]:
    """04: per-token weight and share of the update against response length, and per prompt."""
    fig = Figure(figsize=(15, 4))
    view = length_weights(staircase_lengths(), group_size=4, max_new_tokens=64)
    lengthplots.length_weights_view(fig, view)
    return fig, {"view": view}


def figure_correct_vs_wrong() -> tuple[Figure, dict]:
    """04: the length-bias explorer at its defaults (4 correct of 10 tokens, 4 wrong of 40)."""
    explorer = widgets.length_bias_explorer()
    return explorer.figure, {"values": explorer.values, "view": explorer.artists["view"]}


def figure_batch_dependence() -> tuple[Figure, dict]:
    """04: does a response's per-token weight depend on the other responses of its minibatch?"""
    fig = Figure(figsize=(7, 4))
    view = batch_dependence(np.arange(4, 65, 4), own_length=16, max_new_tokens=64)
    lengthplots.plot_batch_dependence(fig.subplots(), view)
    fig.tight_layout()
    return fig, {"view": view}


FIGURES = {
    "01_worked_example.png": figure_worked_example,
    "01_token_imbalance.png": figure_token_imbalance,
    "01_share_vs_imbalance.png": figure_share_vs_imbalance,
    "02_gradient_error.png": figure_gradient_error,
    "02_gradient_explorer.png": figure_gradient_explorer,
    "04_length_weights.png": figure_length_weights,
    "04_correct_vs_wrong.png": figure_correct_vs_wrong,
    "04_batch_dependence.png": figure_batch_dependence,
}


def main(argv: list[str] | None = None) -> list[Path]:
    torch.set_num_threads(1)  # tiny tensors: a second thread only adds contention
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="directory for the PNGs (default: figures/)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, make in FIGURES.items():
        fig, _ = make()
        path = args.out / name
        fig.savefig(path, dpi=DPI, metadata={"Software": None})
        written.append(path)
        print(f"wrote {path} ({path.stat().st_size // 1024} KB)")
    return written


if __name__ == "__main__":
    main()
