"""The trainer audit on TRL's SFT and DPO trainers and on hand-written loops: 2 gloo ranks x 2 accumulation steps.

Each verdict is derived by hand in docs/audit.md ("Trainers measured") and checked here against
the weights written out longhand:

- TRL SFTTrainer, padded and padding-free: every label token (EOS included, which it appends) 1/N;
- TRL DPOTrainer: every pair the same weight under every configuration (invariant), 1/P up to one
  uniform factor that the test prints (see docs/audit.md);
- accelerate's finetune pattern (the model's own loss under ``accelerator.accumulate``): 1/(W*A*N[r,m]),
  the `local` mode, SKEWED; the same loop with ``gradnorm.integrations.accelerate_loop``: 1/N;
- ``examples/drop_in_sft.py``'s ``accumulate`` in a DDP loop, unchanged: 1/N.
"""

from pathlib import Path

import pytest
import torch

from gradnorm.audit.trainer.audit import audit_trainer
from gradnorm.audit.trainer.data import sft_data

pytestmark = [pytest.mark.slow, pytest.mark.launch]
BUILDS = Path(__file__).resolve().parents[2] / "examples" / "trainers"


_AUDITS: dict = {}


def _audit(spec: str, objective: str = "sft"):
    """One audit per build for the whole module: tests that read the same trainer share its launches."""
    if spec not in _AUDITS:
        _AUDITS[spec] = audit_trainer(f"{BUILDS / spec}", objective, world_sizes=(2,), accum_steps=(2,))
    return _AUDITS[spec]


def _longhand_local(res, mask):
    expected = torch.zeros_like(res.weights)  # 1 / (W * A * N[r, m])
    for rank in res.plan:
        for mb in rank:
            expected[mb] = mask[mb].double() / (len(res.plan) * len(rank) * mask[mb].sum())
    return expected


@pytest.mark.parametrize("build", ["trl_sft.py:build", "trl_sft.py:build_padding_free", "loops.py:accelerate_fixed",
                                  "loops.py:drop_in_sft"])
def test_global_token_mean_is_invariant(build):
    report = _audit(build).report
    assert report.exit_code == 0
    mask = report.batch.mask
    for res in report.results:
        weights = res.weights[mask]
        torch.testing.assert_close(weights, torch.full_like(weights, 1 / int(mask.sum())), rtol=1e-5, atol=0)


def test_sft_trainer_appends_and_counts_eos():
    """TRL appends EOS: every row's last slot (its EOS label) counts, so N is the texts' labels plus one a row."""
    report = _audit("trl_sft.py:build").report
    data = sft_data(16)
    assert int(report.batch.mask.sum()) == sum(len(row) for row in data.rows)
    last = [int(row.nonzero().max()) for row in report.batch.mask]
    assert all(data.rows[i][t].eos for i, t in enumerate(last))


def test_accelerate_model_loss_is_local_and_skewed():
    report = _audit("loops.py:accelerate_model_loss").report
    assert report.exit_code == 1 and report.equals == "local"
    res = report.results[1]
    torch.testing.assert_close(res.weights, _longhand_local(res, report.batch.mask), rtol=1e-5, atol=1e-12)
    control = res.weights[report.batch.mask]  # control: not the global mean the fixed loop gives
    assert float(control.max() / control.min()) > 1.1


def test_dpo_trainer_weighs_every_pair_alike_under_every_split(capsys):
    result = _audit("trl_dpo.py:build", "dpo")
    report = result.report
    assert report.exit_code == 0
    P = report.batch.mask.shape[0] // 2
    ref = report.results[0].weights[report.batch.mask]
    for res in report.results:
        weights = res.weights[report.batch.mask]
        torch.testing.assert_close(weights, ref, rtol=1e-5, atol=0)  # invariant: the same as one process
        assert float(weights.max() / weights.min()) < 1 + 1e-5  # one weight for every pair's every token
    factor = float(ref[0]) * P
    print(f"TRL DPOTrainer: every pair weighs {factor:.6f} / P")
    assert abs(factor - 1) < 0.01  # 1/P up to the uniform factor docs/audit.md reports
