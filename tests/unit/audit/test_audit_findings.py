"""What real SFT/DPO/GRPO code met in the audit's words, each fixed against a loss written out longhand.

- ``decide.decide`` is the public entry for weights read elsewhere (the trainer audit): it gives
  back the report ``audit`` gives, from the same results; a changed weight is told apart (control).
"""

import pytest
import torch

from tests.helpers.audit_command import run, verdict_of

from gradnorm.audit import conventions, decide, verdict

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --- the public entry ------------------------------------------------------------------------------

def test_decide_gives_the_audits_report_from_the_same_results():
    report = decide.audit(conventions.token_sum_over_global_count, (2,), (4,), objective="grpo")
    again = decide.decide(report.name, report.batch, report.results, objective="grpo", tol=report.tol)
    assert verdict.format_report(again) == verdict.format_report(report)
    assert again.exit_code == report.exit_code == 0
    # Control: one rank's tokens doubled in one configuration is no longer invariant.
    results = [*report.results[:-1], report.results[-1]]
    last = results[-1]
    doubled = last.weights.clone()
    doubled[last.plan[0][0]] *= 2
    results[-1] = type(last)(last.label, last.plan, doubled, torch.zeros_like(doubled),
                             update_share=last.update_share, token_share=last.token_share)
    skewed = decide.decide(report.name, report.batch, results, objective="grpo", tol=report.tol)
    assert skewed.exit_code == 1 and verdict.verdict(skewed).startswith("SKEWED")


# --- a step audited as a microbatch loss -----------------------------------------------------------

def a_step(microbatches, *, world_size):
    """An SFT step: every label token over the step's global count, times W (DDP's mean undone)."""
    for mb in microbatches:
        (-(mb["logp"] * mb["mask"]).sum() / mb["num_tokens"] * world_size).backward()


def a_loss_of_three_positional_arguments(logits, labels, weights):
    """Not a step, and refused all the same (SFT passes two): its refusal names no --step (the control)."""
    return logits.sum()


def test_a_step_passed_without_step_is_pointed_at_step(capsys):
    code, out, err = run(capsys, f"{__name__}:a_step", "--objective", "sft", "--world-size", "2")
    assert code == 2 and out == "" and "too many positional arguments" in err
    assert "its first parameter is `microbatches`, a rank's step? audit it with --step" in err
    code, out, _ = run(capsys, f"{__name__}:a_step", "--objective", "sft", "--world-size", "2", "--step")
    assert code == 0 and verdict_of(out).startswith("verdict: INVARIANT")
    code, _, err = run(capsys, f"{__name__}:a_loss_of_three_positional_arguments", "--objective", "sft",
                       "--world-size", "2")
    assert code == 2 and "cannot take the audit's arguments" in err and "--step" not in err
