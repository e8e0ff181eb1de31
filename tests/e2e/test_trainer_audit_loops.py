"""The trainer audit on hand-written loops: 2 gloo ranks x 2 accumulation steps against one process.

Each verdict is derived by hand in docs/audit.md ("Trainers measured") and checked here against
the weights written out longhand:

- accelerate's finetune pattern (the model's own loss under ``accelerator.accumulate``):
  1/(W*A*N[r,m]), the `local` mode, SKEWED: the control;
- the same loop with ``gradnorm.integrations.accelerate_loop``: 1/N;
- ``examples/drop_in_sft.py``'s ``accumulate`` in a DDP loop, unchanged: 1/N;
- ``examples/drop_in_dpo.py``'s ``accumulate`` likewise: 1/P on every token of a pair.

Marked ``trainers``: ``make test-trainers`` runs them (CI does, after ``make test``).
"""

from pathlib import Path

import pytest
import torch

from gradnorm.audit.trainer.audit import audit_trainer
from tests.helpers.trainer_audit import assert_global_token_mean

pytestmark = [pytest.mark.slow, pytest.mark.launch, pytest.mark.trainers]
LOOPS = Path(__file__).resolve().parents[2] / "examples" / "trainers" / "loops.py"


def _audit(build: str, objective: str = "sft"):
    return audit_trainer(f"{LOOPS}:{build}", objective, world_sizes=(2,), accum_steps=(2,)).report


@pytest.mark.parametrize("build", ["accelerate_fixed", "drop_in_sft"])
def test_global_token_mean_is_invariant(build):
    report = _audit(build)
    assert report.exit_code == 0
    assert_global_token_mean(report)


def test_accelerate_model_loss_is_local_and_skewed():
    report = _audit("accelerate_model_loss")
    assert report.exit_code == 1 and report.equals == "local"
    res = report.results[1]
    expected = torch.zeros_like(res.weights)  # longhand: 1 / (W * A * N[r, m])
    for rank in res.plan:
        for mb in rank:
            expected[mb] = report.batch.mask[mb].double() / (len(res.plan) * len(rank) * report.batch.mask[mb].sum())
    torch.testing.assert_close(res.weights, expected, rtol=1e-5, atol=1e-12)
    weights = res.weights[report.batch.mask]  # not the global mean the fixed loop gives
    assert float(weights.max() / weights.min()) > 1.1


def test_dpo_drop_in_weighs_every_pair_one_over_p():
    report = _audit("drop_in_dpo", "dpo")
    assert report.exit_code == 0 and report.equals == "pair"
    P = report.batch.mask.shape[0] // 2
    for res in report.results:
        weights = res.weights[report.batch.mask]
        torch.testing.assert_close(weights, torch.full_like(weights, 1 / P), rtol=1e-5, atol=0)
