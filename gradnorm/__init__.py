"""gradnorm: exact loss normalization for GRPO under data parallelism and gradient accumulation.

Every normalization mode is a per-token weight ``w[i, t]`` in the minibatch objective

    J = sum_{i,t} w[i, t] * l[i, t] * M[i, t]

and the modes differ only in ``w``. The package is laid out as DESIGN.md describes; imports
point inward (core <- shell and step <- trainer; core <- teaching):

Pure core (no torch.distributed)
- ``denominators``  parse a denominator, count tokens, turn counts into weights, the backward loss
- ``grpo``          advantages, clipped surrogate, KL estimators, entropy, statistics
- ``sharding``      explicit assignments of sequences to ranks and microbatches
- ``simulate``      the same weights and gradients for W simulated ranks inside one process
- ``toy``           the toy GRPO problem the notebooks, figures and tests share

Distributed shell and the step
- ``dist``          the only package that touches torch.distributed: ``comm`` (process group, THE
                    all-reduce of counts), ``wrap`` (DDP/FSDP2), ``harness`` (spawned gloo checks)
- ``update``        one rank's accumulation of its microbatches, given the global counts

Trainer
- ``train``, ``trainconfig``, ``rollout``, ``sampling``, ``tinygpt``, ``tasks``, ``hfmodels``,
  ``prompts``, ``checkpointing``, ``preemption``: ``torchrun gradnorm/train.py`` and what it is
  built from

Teaching (notebooks and figures)
- ``plotting``, ``widgets``, ``curves``, ``worked_example`` and the data modules they draw
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
