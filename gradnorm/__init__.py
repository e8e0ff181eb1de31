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
                    all-reduce of counts), ``wrap`` (DDP/FSDP2), ``state`` (the training state by
                    name, sharded checkpoint I/O), ``harness`` (spawned gloo checks)
- ``update``        one rank's accumulation of its microbatches, given the global counts

Trainer
- ``train``, ``runstate``, ``runlog``, ``trainconfig``, ``rollout``, ``sampling``, ``tinygpt``, ``tasks``, ``hfmodels``,
  ``prompts``, ``rewards``, ``checkpointing``, ``export``, ``preemption``, ``preflight``, ``rundir``,
  ``memory``, ``failures``, ``flagrules``, ``scoring``, ``phases``: ``torchrun gradnorm/train.py``
  and what it is built from

Teaching (notebooks and figures)
- ``modes``         the notebooks' mode names: the core's modes plus Dr GRPO's "constant"
- ``imbalance``     notebook 01: a laid-out minibatch, per-token weights, rank shares
- ``sweeps``        notebooks 02 and 05: GRPO, SFT and DPO gradients against the full batch
- ``lengthbias``    notebook 04: how each exact denominator weighs long and short responses
- ``runs``          reading training runs (metrics.jsonl, trailing averages)
- ``plotting``, ``lengthplots``, ``widgets``, ``curves``, ``worked_example``: drawing on a
                    given Axes, sliders wired to it, the learning curve, the worked example
- ``palette``, ``views``, ``canvas``: the one palette; the explorers' views, built once and moved
                    in place; the canvas that redraws only what changed
- ``dist.launch``, ``dist.checks``: the notebooks' torchrun runs and real gloo checks

Audit (is another trainer's loss invariant?)
- ``audit``, ``auditcli``, ``conventions``, ``auditplot``: measure the effective token weights of
                    any microbatch loss (``python -m gradnorm.audit module:function``)
"""

from gradnorm.core.denominators import (
    MODES,
    Counts,
    Denominator,
    count_tokens,
    parse_denominator,
    token_weights,
)

__all__ = ["MODES", "Counts", "Denominator", "count_tokens", "parse_denominator", "token_weights"]
