"""What real SFT/DPO/GRPO code met in the audit's words, each fixed against a loss written out longhand.

- ``decide.decide`` is the public entry for weights read elsewhere (the trainer audit): it gives
  back the report ``audit`` gives, from the same results; a changed weight is told apart (control).
"""

import pytest
import torch

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
