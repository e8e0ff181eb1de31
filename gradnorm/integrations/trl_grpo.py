"""TRL's GRPOTrainer: the `dapo` loss over the token count of the optimizer's own window, one all-reduce a step.

TRL's `dapo` loss divides by ``num_items_in_batch``, counted over the whole generation batch, times
A / steps_per_generation. When one generation batch feeds several optimizer steps
(steps_per_generation > gradient_accumulation_steps), that is the step's own token count only if
every step of the batch holds the same number of tokens; otherwise each step's tokens weigh
1/(N_generation * A / steps_per_generation), and the step's total is N_step over that, not 1 (TRL
#5619, #6024; the trainer audit measures it: docs/audit.md). ``GlobalTokenGRPOTrainer`` counts the
loss tokens of the A microbatches of the current optimizer step on this rank, all-reduces the
count once at the step's first microbatch, and hands TRL a ``num_items_in_batch`` that its own
rescaling turns into exactly that count::

    from gradnorm.integrations.trl_grpo import GlobalTokenGRPOTrainer
    trainer = GlobalTokenGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(..., loss_type="dapo"), ...)

It reads two of TRL's internals (the buffered generation batch and the microbatch counter), so it
refuses a TRL version it was not tested with, in one line, rather than guess.
"""

from __future__ import annotations

import torch

TESTED = {"trl": ("1.16.0",)}
"""TRL versions whose GRPOTrainer the trainer audit measured with this subclass (tests/e2e/test_trainer_audit_trl.py)."""
COUNTED_LOSSES = ("dapo", "cispo", "vespo")  # the loss types TRL divides by num_items_in_batch


def _check_version() -> None:
    import trl

    if trl.__version__ not in TESTED["trl"]:
        raise RuntimeError(f"gradnorm's GlobalTokenGRPOTrainer reads TRL internals and was tested with trl "
                           f"{', '.join(TESTED['trl'])}, not {trl.__version__}: pin one of those, or audit your "
                           "trainer first (python -m gradnorm.audit --trainer BUILD --objective grpo)")


def _make_class():
    from trl import GRPOTrainer

    class GlobalTokenGRPOTrainer(GRPOTrainer):
        """GRPOTrainer whose counted losses divide by the optimizer step's loss tokens over every rank."""

        def __init__(self, *args, **kwargs):
            _check_version()
            super().__init__(*args, **kwargs)
            self._window_tokens = None  # the current optimizer step's count, all-reduced

        def _prepare_inputs(self, generation_batch):
            inputs = super()._prepare_inputs(generation_batch)
            if not self.model.training or self.loss_type not in COUNTED_LOSSES:
                return inputs
            A, per_generation = self.current_gradient_accumulation_steps, self.args.steps_per_generation
            at = self._step % per_generation  # this microbatch's slice of the generation batch (as TRL takes it)
            if self._step % A == 0:  # the step's first microbatch: count its A slices, ONE all-reduce
                first = (at // A) * A
                window = self._buffered_inputs[first:first + A]
                local = sum((w["completion_mask"] * w.get("tool_mask", 1)).sum() for w in window)
                self._window_tokens = self.accelerator.reduce(torch.as_tensor(local).to(self.accelerator.device)
                                                              .float(), reduction="sum")
            # TRL divides by num_items / W * A / steps_per_generation: this makes it N_step / W, so that with
            # DDP's mean over W ranks every token of the step weighs 1 / N_step
            inputs["num_items_in_batch"] = self._window_tokens * per_generation / A
            return inputs

    return GlobalTokenGRPOTrainer


def __getattr__(name: str):
    if name == "GlobalTokenGRPOTrainer":  # TRL is imported only when the class is asked for
        return _make_class()
    raise AttributeError(name)
