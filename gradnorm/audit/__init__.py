"""The audit: the per-token weights any trainer's loss really gives, for every way a batch is split.

- ``objectives``   GRPO, SFT and DPO: what each loss is called with, the point its weights are read
                   at, and the modes it is compared with
- ``contract``     what a GRPO loss is called with (``COUNTS``), how a loss breaks (``ContractError``),
                   and loading it by name (``load_loss``, ``imported_loss``)
- ``synthetic``    the synthetic minibatches losses are audited on: ragged GRPO groups, DPO pairs
- ``splits``       the splits of one minibatch (ranks, microbatches, token budgets, packing,
                   context parallelism, pipelines) as the calls of the loss they produce
- ``masking``      truncated responses and rejected tokens: what the loss should count
- ``measurement``  runs the loss under one layout and reads each token's weight off the gradient
                   (pure: no processes, no torch.distributed)
- ``decide``       compares every configuration with the reference and gradnorm's modes: the Report
- ``diagnosis``    the Report's decision as data: the headline, each axis's skew and cause, the match
- ``verdict``      the diagnosis in words: the verdict line, the table, and why a loss is skewed
- ``pastes``       the command's output pasted in Markdown, regenerated
- ``cli``          ``python -m gradnorm.audit module:function``: the flags and the command
- ``conventions``  a catalogue of published conventions, written from their formulas
- ``plot``         the weight map and each rank's share, drawn on a given Axes
"""

from gradnorm.audit.contract import COUNTS, ContractError, load_loss
from gradnorm.audit.decide import MODES, Report, audit, audit_plans
from gradnorm.audit.measurement import Convention, Point, Result, measure
from gradnorm.audit.objectives import DPO, GRPO, OBJECTIVES, SFT, Objective
from gradnorm.audit.synthetic import (
           SyntheticBatch,
           synthetic_minibatch,
           synthetic_pairs,
)

__all__ = ["COUNTS", "DPO", "GRPO", "MODES", "OBJECTIVES", "SFT", "ContractError", "Convention", "Objective", "Point",
           "SyntheticBatch", "Report", "Result", "audit", "audit_plans", "load_loss", "measure", "synthetic_minibatch",
           "synthetic_pairs"]
