"""The trainer audit on the real transformers Trainer: torchrun launches over gloo, 2 ranks x 2 accumulation steps.

Each case reads every label token's weight out of the Trainer with the probe, against one process
with the whole data set in one microbatch, and checks the verdict derived by hand in
docs/audit.md ("Trainers measured"):

- a model that takes the loss kwargs: the Trainer hands it the step's label count over every rank
  (num_items_in_batch), so every token weighs 1/N under any (W, A): INVARIANT, equal to `token`;
- the control that must fail, a model that takes **kwargs and drops them: each microbatch's own
  mean, times W (the Trainer undoes DDP's mean for a model it believes counts globally), not
  divided by A: weights 1/N[r,m] summing to W*A, SKEWED, named a W*A scale error;
- the dropping model with gradnorm's fix, ``compute_loss_func=global_token_loss``
  (``gradnorm.integrations.hf_trainer``): INVARIANT, `token` again;
- `average_tokens_across_devices` off: each rank divides by its own count, 1/(W*N_r): SKEWED;
- the same Trainer as an unchanged script (``--script``), the control again.

Bad input ends in one ``error:`` line and exit 2.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradnorm.audit.trainer.audit import audit_trainer
from gradnorm.audit.trainer.cli import trainer_lines
from gradnorm.testing import assert_trainer_invariant
from tests.helpers.trainer_audit import assert_global_token_mean

pytestmark = [pytest.mark.slow, pytest.mark.launch, pytest.mark.trainers]  # make test-trainers
ROOT = Path(__file__).resolve().parents[2]
BUILDS = ROOT / "examples" / "trainers" / "hf_trainer.py"


@pytest.fixture(scope="module")
def audits():
    """One audit per build, shared by the tests that read it; the fixed build through gradnorm.testing, as a
    framework's own suite would call it (it returns the report when the trainer passes)."""
    found = {name: audit_trainer(f"{BUILDS}:{name}", world_sizes=(2,), accum_steps=(2,))
             for name in ("build", "build_dropping", "build_per_rank")}
    found["build_dropping_fixed"] = assert_trainer_invariant(f"{BUILDS}:build_dropping_fixed")
    return found


@pytest.mark.parametrize("build", ["build", "build_dropping_fixed"])
def test_loss_kwargs_taken_or_fixed_is_invariant_token(audits, build):
    result = audits[build]
    report = result.report
    assert report.exit_code == 0 and report.equals == "token"
    assert_global_token_mean(report, rtol=1e-6)  # every label token exactly 1/N, fp32 rounding of the gradient aside
    assert report.results[1].world_size == 2 and report.results[1].accum_steps == 2
    assert trainer_lines(result) == []


def test_loss_kwargs_dropped_is_skewed_by_w_times_a(audits):
    result = audits["build_dropping"]
    report = result.report
    assert report.exit_code == 1 and report.equals is None
    res = report.results[1]
    assert float(res.weights.sum()) == pytest.approx(4.0, rel=1e-6)  # W*A
    weights = res.weights[report.batch.mask]
    assert float(weights.max() / weights.min()) > 2  # microbatches of unequal counts: not a uniform scale
    expected = torch.zeros_like(res.weights)  # longhand: each microbatch's own mean, times W, not divided by A
    for rank in res.plan:
        for mb in rank:
            expected[mb] = report.batch.mask[mb].double() / report.batch.mask[mb].sum()
    torch.testing.assert_close(res.weights, expected, rtol=1e-6, atol=1e-12)
    assert any("= W*A times the reference's" in line for line in trainer_lines(result))


def test_assert_trainer_invariant_names_the_loudest_rank_and_the_mode(audits):
    """gradnorm.testing's failure on the dropping model (the control): one message a test log can be read by."""
    with pytest.raises(AssertionError) as failed:
        assert_trainer_invariant(f"{BUILDS}:build_dropping")
    first = str(failed.value).splitlines()[0]
    res = audits["build_dropping"].report.results[1]
    loudest = int((res.update_share - res.token_share).argmax())
    assert f"rank {loudest} takes" in first and "is not invariant on W=2 x A=2" in first
    assert "equal gradnorm's `local`" in first or "equal no gradnorm mode" in first
    assert "= W*A times the reference's" in str(failed.value)


def test_per_rank_average_is_skewed(audits):
    result = audits["build_per_rank"]
    report = result.report
    assert report.exit_code == 1
    res = report.results[1]
    expected = torch.zeros_like(res.weights)  # longhand: 1 / (W * N_r), N_r the rank's labels over its microbatches
    for rank in res.plan:
        rows = torch.cat(rank)
        expected[rows] = report.batch.mask[rows].double() / (len(res.plan) * report.batch.mask[rows].sum())
    torch.testing.assert_close(res.weights, expected, rtol=1e-6, atol=1e-12)


def _audit(*args, timeout=240, tmpdir=None):
    env = dict(os.environ, **({"TMPDIR": str(tmpdir)} if tmpdir else {}))
    return subprocess.run([sys.executable, "-m", "gradnorm.audit", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_unchanged_script_dropping_loss_kwargs_is_skewed():
    # `torchrun` as docs/audit.md types it: the audit runs it from its own environment, activated or not
    proc = _audit("--script", "--", "torchrun", "--standalone", "--nproc_per_node", "2", "examples/trainers/hf_script.py",
                  "--model", "{model}", "--data", "{data}", "--output-dir", "{output_dir}", "--grad-accum", "2",
                  "--drop-loss-kwargs")
    assert proc.returncode == 1, proc.stderr
    assert "verdict: SKEWED" in proc.stdout and "= W*A times the reference's" in proc.stdout


@pytest.mark.parametrize("build, message", [
    ("no_trainer", "returned NoneType, not a trainer"),
    ("never_steps", "ended without an optimizer step"),
    ("raises", "failed on rank 0: RuntimeError: the build failed"),
    ("hangs", "ran past --timeout 8 s and was stopped"),
])
def test_bad_builds_are_one_line(tmp_path, build, message):
    (tmp_path / "builds.py").write_text(
        "import time\n"
        "def no_trainer(model):\n    return None\n"
        "class Idle:\n    def train(self):\n        pass\n"
        "def never_steps(model):\n    return Idle()\n"
        "def raises():\n    raise RuntimeError('the build failed')\n"
        "def hangs():\n    time.sleep(3600)\n")
    temp = tmp_path / "tmp"  # the audit's TMPDIR: its temporary folder must be gone at the end
    temp.mkdir()
    proc = _audit("--trainer", f"{tmp_path / 'builds.py'}:{build}", "--world-size", "1", "--accum-steps", "2",
                  "--timeout", "8", tmpdir=temp)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and message in lines[-1], proc.stderr
    assert "Traceback" not in proc.stderr
    # the audit's folder is gone (torchinductor_<user> is torch's own cache, which importing the audit's package
    # creates in any torch program, the loss audit's too: not a file of the trainer audit)
    assert [p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_")] == []
    assert {p.name for p in tmp_path.iterdir()} <= {"builds.py", "__pycache__", "tmp"}  # nothing beside the build


def test_script_that_never_runs_the_probe_is_refused():
    code = ("import sys, torch; p = torch.nn.Parameter(torch.ones(1)); o = torch.optim.SGD([p], 0.1); "
            "p.sum().backward(); o.step()")
    proc = _audit("--script", "--", sys.executable, "-c", code, "{model}")
    assert proc.returncode == 2 and "never ran the probe model" in proc.stderr, proc.stderr


def test_script_without_placeholder_is_refused():
    proc = _audit("--script", "--", sys.executable, "-c", "pass")
    assert proc.returncode == 2 and "no {model} placeholder" in proc.stderr
