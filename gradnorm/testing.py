"""For other projects' test suites: assert that a trainer gives every token the same weight on any split.

A few lines in a framework's pytest suite::

    from gradnorm.testing import assert_trainer_invariant

    def build(model, tokenizer, train_dataset, *, output_dir, accum_steps, per_device_batch):
        return MyTrainer(model, ..., gradient_accumulation_steps=accum_steps, batch_size=per_device_batch)

    def test_my_trainer_normalizes_globally():
        assert_trainer_invariant(build)                    # SFT; objective="dpo" for a preference trainer

It runs the trainer audit (``python -m gradnorm.audit --trainer``; docs/audit.md): the trainer that
``build`` returns, trained on the probe model once on one process with one microbatch and once on
2 gloo ranks x 2 accumulation steps (torchrun, real processes), every token's weight read out of
the gradient the optimizer takes. It passes when every token weighs what it weighs on one process
(to the audit's tolerance) and the totals agree; otherwise the AssertionError names the loudest
rank, the mode the weights equal, the scale error if any, and the whole report.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from gradnorm.audit.trainer.audit import TrainerReport, audit_trainer
from gradnorm.audit.trainer.cli import trainer_lines
from gradnorm.audit.verdict import format_report

__all__ = ["assert_trainer_invariant"]


def _spec(build: str | Callable) -> str:
    """``file.py:function`` for a function defined at the top level of a file (the audit imports it anew)."""
    if isinstance(build, str):
        return build
    name, path = getattr(build, "__qualname__", ""), inspect.getsourcefile(build)
    if path is None or "." in name or "<" in name:
        raise ValueError(f"{build!r} must be a function defined at the top level of a .py file (the trainer audit "
                         "imports it in fresh processes), or give it as 'file.py:function'")
    return f"{path}:{name}"


def assert_trainer_invariant(build: str | Callable, objective: str = "sft", world_size: int = 2, accum_steps: int = 2,
                             units: int = 16, timeout: float = 300.0) -> TrainerReport:
    """Audit the trainer ``build`` returns on W=world_size x A=accum_steps against one process; raise if it is not invariant.

    Returns the report when it passes, so a test can assert more (``report.report.equals == "token"``).
    """
    spec = _spec(build)
    result = audit_trainer(spec, objective, world_sizes=(world_size,), accum_steps=(accum_steps,), units=units,
                           timeout=timeout)
    if result.exit_code == 0:
        return result
    report = result.report
    worst = max(report.results[1:], key=lambda r: r.change)
    res = worst
    loudest = int((res.update_share - res.token_share).argmax())
    mode = report.equals or (report.near.mode if report.near else None)
    said = [f"{spec} is not invariant on W={world_size} x A={accum_steps}: a token's weight changes by up to "
            f"{100 * worst.change:.1f}% against one process; rank {loudest} takes "
            f"{100 * float(res.update_share[loudest]):.1f}% of the update for {100 * float(res.token_share[loudest]):.1f}% "
            f"of the tokens; " + (f"its weights equal gradnorm's `{mode}`" if mode else "its weights equal no gradnorm mode"),
            *trainer_lines(result), "", format_report(report)]
    raise AssertionError("\n".join(said))
