"""gradnorm: exact loss normalization for GRPO under data parallelism and gradient accumulation.

Every normalization mode is a per-token weight ``w[i, t]`` in the minibatch objective

    J = sum_{i,t} w[i, t] * l[i, t] * M[i, t]

and the modes differ only in ``w``. The package is laid out as DESIGN.md describes:

- ``denominators``  pure core: parse a denominator, count tokens, turn counts into weights
- ``grpo``          pure core: advantages, clipped surrogate, KL estimators, entropy, statistics
- ``parallel``      the thin torch.distributed shell (process group, the one all-reduce of counts)
- ``sharding``      explicit assignments of sequences to ranks and microbatches
- ``simulate``      the same weights and gradients for W simulated ranks inside one process
- ``equivalence``   the multi-process gloo check that the real thing equals the oracle
- ``toy``           the tiny policy and ragged GRPO minibatch that notebooks, figures and tests share
- ``modes``         the notebooks' mode names: the core's modes plus Dr GRPO's "constant"
- ``imbalance``     notebook 01: a laid-out minibatch, per-token weights, rank shares
- ``sweeps``        notebooks 02 and 05: GRPO, SFT and DPO gradients against the full batch
- ``lengthbias``    notebook 04: how each exact denominator weighs long and short responses
- ``runs``          reading training runs (metrics.jsonl, trailing averages)
- ``plotting``, ``lengthplots``, ``widgets``   drawing on a given Axes, sliders wired to it
- ``dist.launch``, ``dist.checks``   the notebooks' torchrun runs and real gloo checks
"""

from gradnorm.denominators import (
    MODES,
    Counts,
    Denominator,
    count_tokens,
    parse_denominator,
    token_weights,
)

__all__ = ["MODES", "Counts", "Denominator", "count_tokens", "parse_denominator", "token_weights"]
