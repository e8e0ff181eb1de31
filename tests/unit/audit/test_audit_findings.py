"""What real SFT/DPO/GRPO code met in the audit's words, each fixed against a loss written out longhand.

- ``decide.decide`` is the public entry for weights read elsewhere (the trainer audit): it gives
  back the report ``audit`` gives, from the same results; a changed weight is told apart (control).
- A step passed without ``--step`` is pointed at it.
- The command's child: a loss that leaves a thread running, closes stdout or raises GeneratorExit
  gets its verdict (or its own failure named); a SIGTERM ends the command with one line, exit 143,
  and the child with it.
- Each verdict finding of issues 53-55 (SCALED for a whole-k scale, each rank by its own count,
  SimPO's margin, one factor said once, only changed configurations named, what the percentage
  and the distance are, float32's tolerance) against a loss written out longhand, with a control.
- The decision is data (``diagnosis.diagnose``) and the verdict its words.
"""

import functools
import math
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.audit_command import run, verdict_of

from gradnorm.audit import (
    composite_conventions,
    conventions,
    decide,
    diagnosis,
    dpo_conventions,
    pastes,
    sft_conventions,
    verdict,
)
from gradnorm.audit.splits import Splits

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


# --- the command's child: what the loss does to its process ----------------------------------------

CHILD_LOSSES = '''
import os, pathlib, sys, threading, time

def _fix(logp, mask, num_tokens, world_size):
    return -(logp * mask).sum() / num_tokens * world_size

def leaves_a_thread(logp, mask, *, num_tokens, world_size):
    threading.Thread(target=time.sleep, args=(3600,)).start()  # not a daemon: it never ends
    return _fix(logp, mask, num_tokens, world_size)

def closes_stdout(logp, mask, *, num_tokens, world_size):
    sys.stdout.close()
    return _fix(logp, mask, num_tokens, world_size)

def raises_generator_exit(logp, mask, *, num_tokens, world_size):
    raise GeneratorExit

def waits(logp, mask, *, num_tokens, world_size):
    pathlib.Path(__file__).with_name("pid").write_text(str(os.getpid()))  # the marker: inside the loss
    time.sleep(3600)
'''

ONE_RUN = ("--objective", "sft", "--world-size", "2", "--accum-steps", "1", "--sharding", "interleave")


def _command(tmp_path, name, *argv, timeout=120):
    (tmp_path / "child_losses.py").write_text(CHILD_LOSSES)
    return subprocess.run([sys.executable, "-m", "gradnorm.audit", f"{tmp_path / 'child_losses.py'}:{name}",
                           *ONE_RUN, *argv], capture_output=True, text=True, timeout=timeout)


@pytest.mark.launch
def test_a_loss_that_leaves_a_thread_running_gets_its_verdict(tmp_path):
    """Before, the child sent its report and then waited on the thread in the interpreter's shutdown,
    and the command waited on the child, past --timeout, forever."""
    done = _command(tmp_path, "leaves_a_thread", "--timeout", "60")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert verdict_of(done.stdout).startswith("verdict: INVARIANT")


@pytest.mark.launch
def test_a_loss_that_closes_stdout_gets_its_verdict_and_a_generator_exit_is_the_loss_s(tmp_path):
    done = _command(tmp_path, "closes_stdout")
    assert done.returncode == 0 and done.stderr == "" and "os._exit" not in done.stdout, done.stderr
    assert verdict_of(done.stdout).startswith("verdict: INVARIANT")
    done = _command(tmp_path, "raises_generator_exit")
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.startswith("error: the loss raised GeneratorExit") and "the audit failed" not in done.stderr


@pytest.mark.launch
def test_sigterm_ends_the_command_with_one_line_and_takes_the_child_with_it(tmp_path):
    (tmp_path / "child_losses.py").write_text(CHILD_LOSSES)
    proc = subprocess.Popen([sys.executable, "-m", "gradnorm.audit", f"{tmp_path / 'child_losses.py'}:waits",
                             *ONE_RUN], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    marker = tmp_path / "pid"
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() or not marker.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert err.strip() == "error: terminated (SIGTERM): no report" and out == ""
    child = int(marker.read_text())
    assert not _alive(child), "the loss's process outlived the command"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended and waiting to be reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


# --- what the verdict says: each finding against a loss written out longhand -------------------------

def twice_per_microbatch(microbatches, *, world_size):
    """An SFT step that calls backward twice per microbatch: every weight 2/N, every gradient 2x."""
    for mb in microbatches:
        for _ in range(2):
            (-(mb["logp"] * mb["mask"]).sum() / mb["num_tokens"] * world_size).backward()


def sum_over_a_constant(logp, mask, *, world_size):
    """A token sum over C = 100, no whole fraction of N: a constant the audit must not call a scale (control)."""
    return -(logp * mask).sum() / 100 * world_size


def test_a_step_that_doubles_every_gradient_is_scaled_not_a_constant(capsys):
    """Before: 'INVARIANT ... equals a constant denominator C = 115' (N = 230), exit 0."""
    code, out, _ = run(capsys, f"{__name__}:twice_per_microbatch", "--objective", "sft", "--step", "--world-size", "2",
                       "--accum-steps", "2")
    line = verdict_of(out)
    n = decide.audit(twice_per_microbatch, (2,), (2,), objective="sft", step=True).batch.mask.sum()
    assert code == 1 and line.startswith("verdict: SCALED: every gradient 2 times too large")
    assert f"C = N / 2 = {float(n) / 2:.6g}" in line and "otherwise invariant" in line
    # The controls: a constant that is no whole fraction of N, and the plain sum (C = 1), stay constants.
    for loss in (sum_over_a_constant, sft_conventions.token_sum):
        report = decide.audit(loss, (2,), (2,), objective="sft")
        assert report.equals == "constant" and report.scaled is None and report.exit_code == 0


def each_rank_by_its_own_count(microbatches, *, world_size):
    """An SFT step over the rank's own token count N_r: w = 1 / (W * N_r) under DDP's mean (transformers'
    Trainer with average_tokens_across_devices off)."""
    n_r = sum(int(mb["mask"].sum()) for mb in microbatches)
    for mb in microbatches:
        (-(mb["logp"] * mb["mask"]).sum() / n_r).backward()


def test_each_rank_by_its_own_count_is_named(capsys):
    """Before: 'SKEWED: ...; equals no gradnorm mode'."""
    code, out, _ = run(capsys, f"{__name__}:each_rank_by_its_own_count", "--objective", "sft", "--step",
                       "--world-size", "2", "--accum-steps", "2")
    line = verdict_of(out)
    assert code == 1 and line.startswith("verdict: SKEWED")
    assert "each rank divides by its own count: rank r's tokens weigh N / (W * N_r) times what gradnorm's `token`" \
        in line and "average_tokens_across_devices" in line and "equals no gradnorm mode" not in line
    # Longhand: rank r's tokens weigh 1 / (W * N_r) on every configuration.
    report = decide.audit(each_rank_by_its_own_count, (2,), (2,), objective="sft", step=True)
    mask = report.batch.mask
    for result in report.results:
        for rank in result.plan:
            rows = torch.cat([torch.as_tensor(mb) for mb in rank])
            expected = 1 / (result.world_size * float(mask[rows].sum()))
            torch.testing.assert_close(result.weights[rows][mask[rows]],
                                       torch.full((int(mask[rows].sum()),), expected, dtype=torch.float64))
    # The controls: the microbatch-local mean (1 / (W A n[r, m])) and a per-pair-share step are no per-rank count.
    assert decide.audit(sft_conventions.model_drops_loss_kwargs, (2,), (2,), objective="sft").per_rank_count is None
    assert decide.audit(dpo_conventions.token_share_of_pair_means, (2,), (2,), objective="dpo",
                        step=True).per_rank_count is None


def test_simpo_s_factor_is_read_as_its_margin():
    """SimPO's 2 sigmoid(gamma) = 1.462 at the audit's beta (= SimPO's) was blamed on beta alone."""
    report = decide.audit(dpo_conventions.simpo_pair_mean_per_microbatch, objective="dpo",
                          beta=dpo_conventions.SIMPO_BETA, world_sizes=(2,), accum_steps=(2,))
    factor = 2 / (1 + math.exp(-dpo_conventions.SIMPO_GAMMA))
    assert report.near.scale == pytest.approx(factor, rel=1e-9)
    line = verdict.verdict(report)
    assert f"a target margin gamma = {dpo_conventions.SIMPO_GAMMA:.4g}" in line
    assert "is that your loss's beta" not in line
    # The control: a plain DPO loss at twice the audit's beta reads as a beta, and no margin can give 2.
    twice = decide.audit(dpo_conventions.pair_sum_over_global_pairs, objective="dpo", beta=0.1, world_sizes=(2,),
                         accum_steps=(2,))
    assert twice.equals == "pair" and verdict.pair_factor_reading(2.0, 0.1).startswith("a beta of 0.2,")
    assert "gamma =" not in verdict.pair_factor_reading(2.0, 0.1)


def test_a_coefficient_times_a_law_is_one_factor_said_once(capsys):
    """Before: 'up to a factor 0.1 x A: ... and weighs every token 0.1 times what `local` gives'."""
    code, out, _ = run(capsys, "gradnorm.audit.composite_conventions:nll_term_per_microbatch", "--world-size", "2",
                       "--accum-steps", "4")
    (line,) = [s for s in out.splitlines() if s.startswith("term 'nll'")]
    assert "up to a factor 0.1 x A, the constant 0.1 (the same under every W and A: a coefficient?) times A" in line
    assert "times what `local` gives" not in line
    # The control: a constant alone is still said as one.
    assert "your loss weighs every token 3 times what `sequence` gives" in verdict.verdict(
        decide.audit(three_times_sequence, (2,), (4,)))


def three_times_sequence(logp, old_logp, advantages, mask, *, num_sequences, world_size):
    """w = 3 / (S * |o_i|): DeepSeekMath's sequence mean, off by a factor 3 under every (W, A)."""
    per_sequence = -torch.where(mask, torch.exp(logp - old_logp) * advantages.unsqueeze(-1), 0.0).sum(-1)
    return 3 * (per_sequence / mask.sum(-1).clamp(min=1)).sum() / num_sequences * world_size


def test_unequal_counts_name_only_the_configurations_that_changed():
    """Before, every configuration with unequal pair counts was named, 0.0% ones too, and the advice to
    audit with --sharding left the token budget on."""
    report = decide.audit(dpo_conventions.pair_mean_per_microbatch, objective="dpo", world_sizes=(8,),
                          accum_steps=(4,), splits=Splits(microbatch_tokens=160))
    results = list(report.results)
    uneven = [i for i, r in enumerate(results) if not r.equal_counts and r.change > report.tol]
    unchanged = uneven[0]
    first = results[unchanged]
    results[unchanged] = type(first)(first.label, first.plan, results[0].weights.clone(),
                                     torch.zeros_like(first.weights), update_share=first.update_share,
                                     token_share=first.token_share, layout=first.layout)
    again = decide.decide(report.name, report.batch, results, objective="dpo", tol=report.tol)
    line = verdict.verdict(again)
    assert again.skewed_only_by_unequal_counts
    named = line.split("when they do not (under ", 1)[1].split(")", 1)[0].split(", ")
    assert first.label not in named  # it did not change: not named
    assert named == [r.label for r in results[1:] if not r.equal_counts and r.change > report.tol]
    assert "audit with --sharding interleave contiguous length and no --microbatch-tokens" in line
    assert "a pair's weight on its tokens changes by up to" in line


def test_the_report_says_what_the_distance_and_the_percentage_are():
    report = decide.audit(conventions.microbatch_token_mean, (2,), (2,))
    text = verdict.format_report(report)
    assert "distance to each mode (max |w - w_mode| / max |w_mode|, worst configuration): " in text
    assert f"(C = N / sum w = {report.constant:.6g}, fitted to the reference)" in text
    n, total = float(report.batch.mask.sum()), float(report.results[0].weights[report.batch.mask].sum())
    assert report.constant == pytest.approx(n / total, rel=1e-12)
    assert f"a token's weight changes by up to {verdict.percent(report.change)} of its weight in one process" in text
    # The percentage is the largest |w - w_ref| / |w_ref| over the counted tokens, longhand.
    ref, mask = report.results[0].weights, report.batch.mask
    worst = max(float(((r.weights - ref)[mask] / ref[mask]).abs().max()) for r in report.results)
    assert report.change == pytest.approx(worst, rel=1e-12)


def test_pastes_regenerates_the_audit_s_output_in_a_page():
    command = ".venv/bin/python -m gradnorm.audit gradnorm.audit.conventions:token_sum_over_global_count --world-size 2"
    own = ".venv/bin/python -m gradnorm.audit my_trainer.py:loss --world-size 2"
    page = f"intro\n```bash\n{command}\n```\n\n```text\nstale\n```\nmiddle\n```bash\n{own}\n```\n\n```text\nmine\n```\n"
    now = pastes.printed(shlex.split(command.split(" -m gradnorm.audit ")[1]))
    assert now.startswith("audit of gradnorm.audit.conventions:token_sum_over_global_count")
    assert pastes.regenerate(page) == page.replace("stale\n", now)  # the user's own file: left as it is


# --- a float32 loss: the tolerance in its own unit ----------------------------------------------------

def _in_float32(fn):
    """``fn`` computed in float32: every floating input cast, as a bf16/fp32 trainer's loss is."""
    @functools.wraps(fn)  # the signature stays fn's, so the audit offers the same counts
    def cast(*args, **kwargs):
        return fn(*[a.float() if a.is_floating_point() else a for a in args], **kwargs)
    return cast


FLOAT32 = [(conventions.token_sum_over_global_count, "grpo"), (conventions.sequence_mean_then_batch_mean, "grpo"),
           (conventions.group_mean_then_mean_of_groups, "grpo"), (sft_conventions.token_sum_over_num_items, "sft"),
           (sft_conventions.sequence_mean_over_sequences, "sft")]


@pytest.mark.parametrize("fn, objective", FLOAT32, ids=[fn.__name__ for fn, _ in FLOAT32])
def test_a_float32_loss_reads_within_the_stated_margin_and_the_report_says_its_tolerance(fn, objective):
    """The catalogue's right losses, cast to float32, at W 16 x A 8: each matches its mode within a quarter
    of FLOAT_MARGIN unit roundoffs, and the report says --tol in float32's unit."""
    report = decide.audit(_in_float32(fn), (16,), (8,), objective=objective)
    unit = torch.finfo(torch.float32).eps / 2
    assert report.equals is not None and report.exit_code == 0
    assert 0 < report.distance[report.equals] <= verdict.FLOAT_MARGIN * unit / 4  # rounded, and within the margin
    line = verdict.tolerance_line(report)
    assert line == f"tolerance: 1e-06 relative, {1e-6 / unit:.3g} unit roundoffs of float32 ({unit:.3g}), the dtype " \
                   "your loss returns" and line in verdict.format_report(report)
    assert 1e-6 >= verdict.FLOAT_MARGIN * unit  # the default leaves the margin


def test_a_tolerance_below_float32_s_rounding_is_flagged_and_float64_says_nothing():
    fn = conventions.token_sum_over_global_count
    tight = decide.audit(_in_float32(fn), (2,), (2,), tol=1e-7)
    assert "below the 16 a float32 loss's own rounding may read: raise --tol" in verdict.tolerance_line(tight)
    assert verdict.tolerance_line(decide.audit(fn, (2,), (2,))) is None  # the control: float64


# --- the decision as data ------------------------------------------------------------------------------

def test_the_diagnosis_is_data_the_words_only_say_it():
    """A DPO pair mean per microbatch under a token budget: the counts skew, on the configurations that
    changed, with `pair` matched where counts are equal and `local` everywhere; the verdict is its words."""
    report = decide.audit(dpo_conventions.pair_mean_per_microbatch, objective="dpo", world_sizes=(4,),
                          accum_steps=(2,), splits=Splits(microbatch_tokens=160), shardings=("interleave", "length"))
    found = diagnosis.diagnose(report)
    assert found.headline == "SKEWED" and found.match == diagnosis.Match("mode", "local")
    (skew,) = found.skews
    changed = tuple(r.label for r in report.results[1:] if not r.equal_counts and r.change > report.tol)
    assert (skew.axis, skew.mode, skew.where, skew.even, skew.budget) == ("counts", "pair", changed,
                                                                           ("interleave", "length"), True)
    assert skew.change == report.change
    assert verdict.verdict(report) == verdict.words(report, found)
    # The control: the fix's diagnosis has no skew and matches `pair`.
    fix = decide.audit(dpo_conventions.pair_sum_over_global_pairs, objective="dpo", world_sizes=(4,),
                       accum_steps=(2,), splits=Splits(microbatch_tokens=160), shardings=("interleave", "length"))
    assert diagnosis.diagnose(fix) == diagnosis.Diagnosis("INVARIANT", (), diagnosis.Match("mode", "pair"))
