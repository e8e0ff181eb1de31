"""The trainer audit on gradnorm's own GRPO trainer (gradnorm/train.py, unchanged): 2 gloo ranks x 2 accumulation
steps against one process, one build per --loss-denominator (examples/trainers/gradnorm_grpo.py).

Each verdict is derived by hand in docs/audit.md ("Trainers measured"). The trainer centers a group's
rewards {0, 1} and divides by the group's Bessel std sqrt(1/2) plus 1e-6 (``core.grpo.group_advantages``),
so its advantage is c' = 0.5 / (sqrt(1/2) + 1e-6) where the probe assumes TRL's c = 0.5 / (sqrt(1/2) + 1e-4):
every weight reads f = c' / c = (sqrt(1/2) + 1e-4) / (sqrt(1/2) + 1e-6) times the mode's, the same in every
run (the Decision's "advantages" law, INVARIANT). Hence:

- ``token`` (the default): 1/N of the step's completion tokens, times f;
- ``sequence``: 1/(S*|o_i|), times f;
- a constant C = 64: 1/C, read as C / f (the factor is one uniform number; the runs' N differ: the builds seed
  each configuration differently, so that a constant and a token mean cannot read alike);
- ``local``, the control that must fail: 1/(W*A*N[r,m]), a microbatch's own mean: at W = A = 1 it is 1/N,
  under W=2 A=2 it is `local` and not `token`: SKEWED.

The GRPO drop-in (examples/drop_in_ddp.py's ``accumulate``, unchanged, in a DDP loop over the probe's sampled
completions: examples/trainers/drop_in_grpo.py) divides by TRL's std + 1e-4, so its factor is 1: ``token``
exactly, and its ``denominator="local"`` `local`, SKEWED.

Marked ``trainers`` (``make test-trainers``), like TRL's: six builds, two launches each.
"""

import math
from pathlib import Path

import pytest

from gradnorm.audit.trainer.audit import audit_trainer
from gradnorm.audit.trainer.generated import ADVANTAGE

pytestmark = [pytest.mark.slow, pytest.mark.launch, pytest.mark.trainers]
BUILDS = Path(__file__).resolve().parents[2] / "examples" / "trainers"
FACTOR = (math.sqrt(0.5) + 1e-4) / (math.sqrt(0.5) + 1e-6)  # c' / c, by hand (module docstring)
TOL = 1e-5

_AUDITS: dict = {}


def _audit(build: str, file: str = "gradnorm_grpo.py"):
    """One audit per build for the whole module: the tests that read the same build share its launches."""
    if (file, build) not in _AUDITS:
        _AUDITS[file, build] = audit_trainer(f"{BUILDS / file}:{build}", "grpo", world_sizes=(2,), accum_steps=(2,))
    return _AUDITS[file, build].report


def test_the_advantage_factor_is_the_trainers_std_epsilon():
    assert FACTOR == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-6) / ADVANTAGE, rel=1e-12)
    assert abs(FACTOR - 1) > 10 * TOL  # the factor is visible at the audit's tolerance: it is read, not lost


@pytest.mark.parametrize("build, mode", [("build", "token"), ("build_sequence", "sequence")])
def test_a_global_denominator_is_invariant(build, mode):
    report = _audit(build)
    decision = report.decision()
    assert report.exit_code == 0 and decision.shape == mode and decision.law == "advantages"
    for run in report.runs:
        fit = report.fits(run)[mode]
        assert fit.distance < TOL and fit.factor == pytest.approx(FACTOR, rel=TOL)
        assert len(run.completions) == 16 and len({c.prompt for c in run.completions}) == 8  # whole groups
        assert run.stray < TOL and run.unsure == 0
    assert report.runs[1].world_size == 2 and report.runs[1].accum_steps == 2


def test_the_runs_sample_batches_of_different_n():
    """What lets a constant denominator be told from a token mean: the builds seed each configuration apart."""
    report = _audit("build")
    assert len({run.tokens for run in report.runs}) == len(report.runs)


def test_a_constant_denominator_reads_as_one():
    report = _audit("build_constant")
    decision = report.decision()
    assert report.exit_code == 0 and decision.law == "constant"
    assert decision.constant == pytest.approx(64 / FACTOR, rel=TOL)  # C = 64, read through c' / c
    for run in report.runs:
        assert report.fits(run)["token"].factor == pytest.approx(FACTOR * run.tokens / 64, rel=TOL)


def test_control_local_is_skewed():
    """--loss-denominator local: each microbatch by its own count. One process with one microbatch is the global
    mean; under W=2 A=2 the weights are 1/(W*A*N[r,m]), `local` and no invariant mode."""
    report = _audit("build_local")
    reference, split = (report.fits(run) for run in report.runs)
    assert reference["token"].distance < TOL and reference["token"].factor == pytest.approx(FACTOR, rel=TOL)
    assert split["local"].distance < TOL and split["local"].factor == pytest.approx(FACTOR, rel=TOL)
    assert split["token"].distance > 1e-2  # the microbatches' counts differ: far from the global mean
    assert report.exit_code == 1 and report.verdict().startswith("SKEWED")
    assert "equals `local`" in report.verdict()


def test_the_grpo_drop_in_is_the_global_token_mean():
    report = _audit("drop_in_grpo", "drop_in_grpo.py")
    assert report.exit_code == 0 and report.decision().shape == "token" and report.decision().law == "exact"
    for run in report.runs:
        fit = report.fits(run)["token"]
        assert fit.distance < TOL and fit.factor == pytest.approx(1, abs=TOL)
        assert run.unsure == 0 and len(run.completions) == 16


def test_control_the_grpo_drop_in_with_local_is_skewed():
    report = _audit("drop_in_grpo_local", "drop_in_grpo.py")
    split = report.fits(report.runs[1])
    assert split["local"].distance < TOL and split["local"].factor == pytest.approx(1, abs=TOL)
    assert split["token"].distance > 1e-2
    assert report.exit_code == 1 and "equals `local`" in report.verdict()
