"""The audit: the per-token weights any trainer's loss really gives, for every way a batch is split.

- ``probe``        runs a loss under simulated ranks, microbatches and shardings and reads each
                   token's weight off the gradient (pure: no processes, no torch.distributed)
- ``cli``          ``python -m gradnorm.audit module:function``: the report and its verdict
- ``conventions``  a catalogue of published conventions, written from their formulas
- ``plot``         the weight map and each rank's share, drawn on a given Axes
"""

from gradnorm.audit.probe import (
    COUNTS,
    MODES,
    ContractError,
    Convention,
    SyntheticBatch,
    Report,
    Result,
    audit,
    audit_plans,
    load_loss,
    measure,
    synthetic_minibatch,
)

__all__ = ["COUNTS", "MODES", "ContractError", "Convention", "SyntheticBatch", "Report", "Result", "audit",
           "audit_plans", "load_loss", "measure", "synthetic_minibatch"]
