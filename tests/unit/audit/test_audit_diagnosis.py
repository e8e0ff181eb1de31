"""The audit says what is wrong with a loss, not only that it is wrong, and refuses what it cannot judge.

- A loss with the wrong sign (the objective returned, or logp and old_logp swapped) fails with one
  line that says so; the fix does not.
- A loss file with ``from __future__ import annotations``, a ``@dataclass`` and an import of a
  module beside it loads from any working directory, and leaves sys.path and sys.modules as it
  found them.
- W = A = 1 everywhere compares nothing: one ``error:`` line, exit 2.
- A loss that is a mode times one uniform factor per configuration is named with that factor in
  W and A (``1/W``: the missing world-size factor), or as a number; a correct loss is not.
- A loss skewed only where microbatches hold different numbers of sequences is told so, and
  ``--help`` says what every sharding does.

Each loss below is written out longhand from the clipped surrogate at ratio 1 (the audit runs on
policy), so the expected weights are read off the formula in its docstring.
"""

import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tests.helpers.audit_command import run, verdict_of

from gradnorm.audit import contract, conventions, decide, verdict
from gradnorm.audit.cli import main
from gradnorm.core.sharding import SHARD_KINDS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[3]
SMALL = ["--world-size", "2", "--accum-steps", "4"]  # W != A, so 1/W and 1/A can be told apart


def _surrogate_sum(logp, old_logp, advantages, mask):
    """sum_{i,t} -rho[i, t] * A_i * M[i, t], rho = exp(logp - old_logp): d/dlogp = -A_i at ratio 1."""
    ratio = torch.exp(logp - old_logp)  # (n, T)
    return -torch.where(mask, ratio * advantages.unsqueeze(-1), 0.0).sum()


def the_fix(logp, old_logp, advantages, mask, *, num_tokens, world_size):
    """w = 1/N: the global token sum over the global count, times W to undo DDP's mean."""
    return _surrogate_sum(logp, old_logp, advantages, mask) / num_tokens * world_size


def returns_the_objective(logp, old_logp, advantages, mask, *, num_tokens, world_size):
    """w = -1/N: the quantity to maximize, handed to a minimizer."""
    return -the_fix(logp, old_logp, advantages, mask, num_tokens=num_tokens, world_size=world_size)


def swaps_logp_and_old_logp(logp, old_logp, advantages, mask, *, num_tokens, world_size):
    """w = -1/N: rho = exp(old_logp - logp) has derivative -1 at ratio 1."""
    return the_fix(old_logp, logp, advantages, mask, num_tokens=num_tokens, world_size=world_size)


def without_world_size(logp, old_logp, advantages, mask, *, num_tokens):
    """w = 1/(W * N): the fix without x W, so DDP's mean divides every weight by W."""
    return _surrogate_sum(logp, old_logp, advantages, mask) / num_tokens


def divided_by_accum(logp, old_logp, advantages, mask, *, num_tokens, world_size, accum_steps):
    """w = 1/(A * N): N already counts every microbatch, so this / A is one too many."""
    return the_fix(logp, old_logp, advantages, mask, num_tokens=num_tokens, world_size=world_size) / accum_steps


def three_times_sequence(logp, old_logp, advantages, mask, *, num_sequences, world_size):
    """w = 3 / (S * |o_i|): DeepSeekMath's sequence mean, off by a factor 3 under every (W, A)."""
    per_sequence = -torch.where(mask, torch.exp(logp - old_logp) * advantages.unsqueeze(-1), 0.0).sum(-1)
    return 3 * (per_sequence / mask.sum(-1).clamp(min=1)).sum() / num_sequences * world_size


def sequence_mean_per_microbatch(logp, old_logp, advantages, mask, *, accum_steps):
    """w = 1 / (W * A * n[r, m] * |o_i|): the mean over the microbatch's n[r, m] sequences of their means."""
    ratio = torch.exp(logp - old_logp)
    per_sequence = -torch.where(mask, ratio * advantages.unsqueeze(-1), 0.0).sum(-1) / mask.sum(-1)  # (n,)
    return per_sequence.mean() / accum_steps


# --- 1. the wrong sign ---------------------------------------------------------------------------

SIGN = "your loss rises where the advantage is positive"


@pytest.mark.parametrize("loss", [returns_the_objective, swaps_logp_and_old_logp])
def test_a_loss_with_the_wrong_sign_fails_and_says_why(loss):
    report = decide.audit(loss, (2,), (4,), ("interleave",))
    torch.testing.assert_close(report.results[0].weights[report.batch.mask],
                               -torch.ones(int(report.batch.mask.sum()), dtype=torch.float64) / report.batch.mask.sum())
    assert report.invariant and report.wrong_sign and report.exit_code == 1


def test_the_command_exits_1_with_one_line_that_names_the_sign(capsys):
    code, out, err = run(capsys, f"{__name__}:returns_the_objective", *SMALL)
    assert code == 1 and err == ""
    line = verdict_of(out)
    assert SIGN in line and "objective" in line and "swapped logp and old_logp" in line
    assert "INVARIANT" not in line
    code, out, _ = run(capsys, f"{__name__}:the_fix", *SMALL)  # the control
    assert code == 0 and SIGN not in out and verdict_of(out).startswith("verdict: INVARIANT")
    assert not decide.audit(the_fix, (2,), (4,), ("interleave",)).wrong_sign


# --- 2. loading a file ---------------------------------------------------------------------------

LOSS_FILE = '''
from __future__ import annotations

from dataclasses import dataclass

import torch
from neighbour import SCALE


@dataclass
class Config:
    scale: float = SCALE


def loss(logp, old_logp, advantages, mask, *, num_tokens, world_size):
    from lazy_neighbour import ONE  # imported on the first call, after the file has loaded
    ratio = torch.exp(logp - old_logp)
    total = -torch.where(mask, ratio * advantages[:, None], 0.0).sum()
    return Config().scale * ONE * total / num_tokens * world_size
'''


def write_loss_file(folder, scale):
    folder.mkdir()
    (folder / "loss.py").write_text(textwrap.dedent(LOSS_FILE))
    (folder / "neighbour.py").write_text(f"SCALE = {scale}\n")
    (folder / "lazy_neighbour.py").write_text("ONE = 1.0\n")
    return folder / "loss.py"


def test_a_file_with_a_dataclass_and_a_neighbour_loads_from_anywhere(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the command runs from elsewhere than the loss file's folder
    right, twice = write_loss_file(tmp_path / "a", 1.0), write_loss_file(tmp_path / "b", 2.0)
    path_before, modules_before = list(sys.path), set(sys.modules)
    code, out, err = run(capsys, f"{right}:loss", *SMALL, "--sharding", "interleave")
    assert (code, err) == (0, "") and "equals gradnorm's `token`" in out
    # The same file name in another folder, with its own neighbour: not the first one's modules.
    code, out, err = run(capsys, f"{twice}:loss", *SMALL, "--sharding", "interleave")
    assert (code, err) == (1, "") and "SCALED: every gradient 2 times too large" in out  # w = 2/N: SCALE = 2
    assert sys.path == path_before
    assert not {m for m in set(sys.modules) - modules_before
                if str(tmp_path) in str(getattr(sys.modules[m], "__file__", None) or "")}


def test_a_loaded_file_is_a_registered_module_under_a_name_of_its_own(tmp_path):
    path = write_loss_file(tmp_path / "c", 1.0)
    with contract.imported_loss(f"{path}:loss") as fn:
        assert sys.modules[fn.__module__].__file__ == str(path)
        assert fn.__module__ not in ("loss", "__main__")
        assert decide.audit(fn, (2,), (1,), ("interleave",)).equals == "token"  # the lazy import works here
    assert fn.__module__ not in sys.modules


# --- 3. nothing to compare -----------------------------------------------------------------------

def test_one_process_with_one_microbatch_is_refused(capsys):
    code, out, err = run(capsys, f"{__name__}:the_fix", "--world-size", "1", "--accum-steps", "1")
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: nothing to compare"), err
    with pytest.raises(contract.ContractError, match="nothing to compare"):
        decide.audit(the_fix, (1,), (1,))
    code, out, err = run(capsys, f"{__name__}:the_fix", "--world-size", "1", "--accum-steps", "2")  # the control
    assert code == 0 and err == ""


# --- 4. right up to a factor ---------------------------------------------------------------------

@pytest.mark.parametrize("loss, argv, expected", [
    (without_world_size, SMALL, "equals gradnorm's `token` up to a factor 1/W: your loss is missing the "
                                "world-size factor"),
    (divided_by_accum, SMALL, "equals gradnorm's `token` up to a factor 1/A: your loss divides by A once too "
                              "often"),
    (the_fix, [*SMALL, "--reduction", "sum"], "equals gradnorm's `token` up to a factor W: your loss has a "
                                             "factor W too many"),
    (conventions.microbatch_token_mean, [*SMALL, "--scale-by-accum"],
     "equals gradnorm's `local` up to a factor 1/A: your loss divides by A once too often"),
    (three_times_sequence, SMALL, "equals gradnorm's `sequence` up to a factor 3: your loss weighs every token 3 "
                                  "times what `sequence` gives"),
])
def test_a_uniform_factor_is_named_in_w_and_a(loss, argv, expected, capsys):
    code, out, err = run(capsys, f"{loss.__module__}:{loss.__name__}", *argv)
    # A factor the same under every (W, A) leaves the loss invariant (the learning rate absorbs it): exit 0.
    assert code == (0 if loss is three_times_sequence else 1) and err == ""
    assert expected in verdict_of(out), verdict_of(out)


def test_when_w_equals_a_both_readings_are_given(capsys):
    _, out, _ = run(capsys, f"{__name__}:without_world_size", "--world-size", "4", "--accum-steps", "4")
    assert "up to a factor 1/W or 1/A" in verdict_of(out)


def test_controls_get_no_factor():
    for loss in (the_fix, conventions.sequence_mean_then_batch_mean, conventions.token_sum_over_constant):
        report = decide.audit(loss, (2,), (4,))
        assert report.equals and report.near is None and report.exit_code == 0
    near = decide.audit(without_world_size, (2,), (4,)).near
    assert (near.mode, near.scale, near.powers) == ("token", pytest.approx(1.0), ((-1, 0),))
    # A loss that reads padding is no mode times anything: the factor stays unsaid.
    leaky = decide.audit(_reads_padding, (2,), (4,))
    assert leaky.equals is None and leaky.near is None


def _reads_padding(logp, old_logp, advantages, mask, *, num_tokens, world_size):
    return -(torch.exp(logp - old_logp) * advantages[:, None]).sum() / num_tokens * world_size


# --- 5. unequal sequence counts --------------------------------------------------------------------

EQUAL = "invariant whenever every microbatch holds the same number of sequences"


def test_a_loss_skewed_only_by_unequal_sequence_counts_is_told_so(capsys):
    code, out, err = run(capsys, f"{__name__}:sequence_mean_per_microbatch", "--world-size", "8", "--accum-steps", "4")
    assert code == 1 and err == ""
    line = verdict_of(out)
    report = decide.audit(sequence_mean_per_microbatch, (8,), (4,))
    assert report.skewed_only_by_unequal_counts and report.equals_at_equal_counts == "sequence"
    assert f"{EQUAL}, where it equals gradnorm's `sequence`" in line
    assert f"skewed by up to {verdict.percent(report.change)} when they do not (under " in line
    assert "--sharding interleave contiguous length" in line
    # The catalogue's mean of sequence means prints the same line, as docs/audit.md pastes it.
    _, out, _ = run(capsys, "gradnorm.audit.conventions:microbatch_mean_of_sequence_means", "--world-size", "8",
                    "--accum-steps", "4")
    assert f"```text\n{verdict_of(out)}\n```" in (ROOT / "docs" / "audit.md").read_text()


@pytest.mark.parametrize("loss", [conventions.microbatch_token_mean, the_fix])
def test_controls_skewed_everywhere_or_nowhere_are_not_told_so(loss, capsys):
    _, out, _ = run(capsys, f"{loss.__module__}:{loss.__name__}", *SMALL)
    assert EQUAL not in out
    assert not decide.audit(loss, (2,), (4,)).skewed_only_by_unequal_counts


def test_help_says_what_every_sharding_does(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for kind in SHARD_KINDS:
        assert f"{kind}: " in text, kind
    balanced = text.split("balanced: ", 1)[1]
    assert "longest" in balanced and "different numbers of sequences" in balanced and "rank 0" in balanced


def test_percent_never_reads_zero_for_a_nonzero_change():
    assert verdict.percent(0.0) == "0.0%" and verdict.percent(0.123) == "12.3%"
    assert verdict.percent(3e-5) == "0.003%" and verdict.percent(3.14e-10) == "3.1e-08%"
    # float rounding, at or below the audit's tolerance, is no signal: it reads 0.0% (the control: just above it)
    assert verdict.percent(1.4e-14, rounding=1e-9) == "0.0%" and verdict.percent(3e-9, rounding=1e-9) == "3e-07%"


def token_mean_in(dtype):
    def loss(logp, old_logp, advantages, mask, num_tokens, world_size):
        per = torch.where(mask, -advantages.unsqueeze(-1) * logp, 0.0).to(dtype)  # the token loss rounded to 16 bits
        return per.sum() / num_tokens * world_size
    loss.__name__ = f"token_mean_in_{str(dtype).split('.')[-1]}"
    return loss


@pytest.mark.parametrize("dtype, says", [
    (torch.float16, "which is gradnorm's `token` to within the rounding of float16 or bfloat16 ("),
    (torch.bfloat16, "which is gradnorm's `token` to within the rounding of bfloat16 ("),
])
def test_a_16_bit_token_mean_is_named_as_token_rounded_not_as_an_odd_constant(dtype, says):
    """Before, a float16 token mean read "equals a constant denominator C = 954.987" (N = 955)."""
    report = decide.audit(token_mean_in(dtype), (2,), (4,))
    line = verdict.verdict(report)
    assert report.equals == "constant" and report.rounded == ("token", says.split("rounding of ")[1][:-2])
    assert says in line and "audit it in float32" in line, line
    control = decide.audit(token_mean_in(torch.float64), (2,), (4,))  # full precision: plain `token`, no rounding
    assert control.rounded is None and verdict.verdict(control).endswith("equals gradnorm's `token`")


def test_a_genuine_constant_is_not_taken_for_rounding():
    report = decide.audit(conventions.token_sum_over_constant, (2,), (4,))
    assert report.equals == "constant" and report.rounded is None
    assert "rounding" not in verdict.verdict(report)


def test_a_minibatch_on_which_every_mode_ties_says_so_instead_of_naming_local(capsys):
    """Every response 1 token long: local, token, sequence and group weigh alike. Before, the verdict
    read "equals gradnorm's `local`", the bug's own mode, for the fix."""
    code, out, _ = run(capsys, f"{__name__}:the_fix", "--max-new-tokens", "1", *SMALL)
    line = verdict_of(out)
    assert code == 0 and "equals gradnorm's `local`, `token`, `sequence`, `group` and a constant C = 16 alike" in line
    assert "every response 1 token long" in line and "--max-new-tokens above 1" in line, line
    _, out, _ = run(capsys, f"{__name__}:the_fix", "--max-new-tokens", "2", *SMALL)  # the control: lengths vary
    assert verdict_of(out).endswith("equals gradnorm's `token`"), verdict_of(out)


def token_mean_from_kwargs(logp, old_logp, advantages, mask, **counts):
    return torch.where(mask, -advantages.unsqueeze(-1) * logp, 0.0).sum() / counts["num_tokens"] * counts["world_size"]


def token_mean_from_names(logp, old_logp, advantages, mask, num_tokens, world_size):
    return torch.where(mask, -advantages.unsqueeze(-1) * logp, 0.0).sum() / num_tokens * world_size


def test_a_loss_taking_kwargs_gets_every_count():
    """Before, a loss written with **counts got no counts at all (KeyError: 'num_tokens')."""
    by_kwargs = decide.audit(token_mean_from_kwargs, (2,), (4,))
    by_names = decide.audit(token_mean_from_names, (2,), (4,))  # the control: the counts asked for by name
    assert by_kwargs.equals == by_names.equals == "token"
    assert torch.equal(by_kwargs.results[-1].weights, by_names.results[-1].weights)
