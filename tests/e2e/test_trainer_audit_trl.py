"""The trainer audit on TRL's trainers (1.16): 2 gloo ranks x 2 accumulation steps against one process.

Each verdict is derived by hand in docs/audit.md ("Trainers measured") and checked here against
the weights written out longhand:

- SFTTrainer, padded and padding-free: every label token (EOS included, which it appends) 1/N;
- DPOTrainer: every pair 1/P, every token of a pair its pair's weight (bf16 off: see the builds);
- GRPOTrainer: `dapo` the token mean 1/N and `grpo` the sequence mean 1/(S*|o_i|), each on its own
  sampled batch; `dr_grpo` a constant 1/(S * max_completion_length); `dapo` with steps_per_generation = 2 * A a token mean times a per-step factor
  (its count spans the generation batch: TRL #5619), the control that must fail, and the same with
  ``gradnorm.integrations.trl_grpo.GlobalTokenGRPOTrainer``: the token mean 1/N again.

Marked ``trainers``: ``make test-trainers`` runs them (CI does, after ``make test``); ``make test`` leaves
them out to stay inside its time.
"""

from pathlib import Path

import pytest
import torch

from gradnorm.audit.trainer.audit import audit_trainer
from tests.helpers.trainer_audit import assert_global_token_mean
from gradnorm.audit.trainer.data import sft_data

pytestmark = [pytest.mark.slow, pytest.mark.launch, pytest.mark.trainers]
BUILDS = Path(__file__).resolve().parents[2] / "examples" / "trainers"


_AUDITS: dict = {}


def _audit(spec: str, objective: str = "sft"):
    """One audit per build for the whole module: tests that read the same trainer share its launches."""
    if spec not in _AUDITS:
        _AUDITS[spec] = audit_trainer(f"{BUILDS / spec}", objective, world_sizes=(2,), accum_steps=(2,))
    return _AUDITS[spec]


@pytest.mark.parametrize("build", ["trl_sft.py:build", "trl_sft.py:build_padding_free"])
def test_global_token_mean_is_invariant(build):
    report = _audit(build).report
    assert report.exit_code == 0
    assert_global_token_mean(report)


def test_sft_trainer_appends_and_counts_eos():
    """TRL appends EOS: every row's last slot (its EOS label) counts, so N is the texts' labels plus one a row."""
    report = _audit("trl_sft.py:build").report
    data = sft_data(16)
    assert int(report.batch.mask.sum()) == sum(len(row) for row in data.rows)
    last = [int(row.nonzero().max()) for row in report.batch.mask]
    assert all(data.rows[i][t].eos for i, t in enumerate(last))


def test_dpo_trainer_weighs_every_pair_one_over_p():
    report = _audit("trl_dpo.py:build", "dpo").report
    assert report.exit_code == 0 and report.equals == "pair"
    P = report.batch.mask.shape[0] // 2
    for res in report.results:
        weights = res.weights[report.batch.mask]
        torch.testing.assert_close(weights, torch.full_like(weights, 1 / P), rtol=1e-5, atol=0)


@pytest.mark.parametrize("build, mode, whole_groups", [
    ("trl_grpo.py:build_dapo", "token", True), ("trl_grpo.py:build_grpo", "sequence", True),
    ("trl_grpo.py:build_dapo_two_steps_fixed", "token", False),  # a generation batch of two steps splits groups
])
def test_grpo_trainer_equals_its_mode_on_every_run(build, mode, whole_groups):
    report = _audit(build, "grpo").report
    assert report.exit_code == 0 and report.decision().shape == mode and report.decision().law == "exact"
    for run in report.runs:
        fit = report.fits(run)[mode]
        assert fit.distance < 1e-5 and fit.factor == pytest.approx(1, abs=1e-5)
        groups = len({c.prompt for c in run.completions})
        assert (groups * 2 == len(run.completions)) == whole_groups  # both completions of a prompt in the step
    assert report.runs[1].world_size == 2 and report.runs[1].accum_steps == 2


def test_grpo_dr_grpo_is_a_constant_denominator():
    """Dr GRPO's loss divides a microbatch by its sequences times max_completion_length: over the step, a constant
    C = S * 16 whatever N each run happened to sample."""
    report = _audit("trl_grpo.py:build_dr_grpo", "grpo").report
    decision = report.decision()
    assert report.exit_code == 0 and decision.law == "constant"
    assert decision.constant == pytest.approx(16 * 16, rel=1e-5)  # S = 16 completions, max_completion_length 16
    assert len({run.tokens for run in report.runs}) > 1  # the runs sampled different N: a token mean would differ


def test_grpo_dapo_counting_two_steps_is_off_by_a_factor():
    """The control: the count spans the generation batch (two optimizer steps), rescaled by A / steps_per_generation:
    a token mean whose step weighs N_step / (N_generation / 2) instead of 1 (TRL #5619, #6024)."""
    report = _audit("trl_grpo.py:build_dapo_two_steps", "grpo").report
    assert report.exit_code == 1 and report.decision().law == "varies" and report.verdict().startswith("SKEWED")
    for run in report.runs:
        fit = report.fits(run)["token"]
        assert fit.distance < 1e-5 and abs(fit.factor - 1) > 1e-3
