"""The audit for every objective: SFT and DPO losses, a rank's step, and composite losses term by term.

What must hold:
- an SFT loss built from ``gradnorm.sft_weights`` and a DPO loss built from
  ``gradnorm.pair_weights`` read back, token for token, as the weights written out longhand here
  (1/N per label token; 1/P, or 1/(P |y|) length-normalized, on every token of a pair), under
  fixed-count plans and token budgets, and the audit names their mode; a wrong weight (2/N) is
  named by none (the control);
- a rank's step that runs its own loop (``--step``) is measured as it runs: accelerate's division
  by G equals the same loss written per microbatch, token for token, and a step that forgets the
  division reads A times too loud (the control); OLMo-core's token share reads exactly
  T_mb / (T_rank * P[r, m] * W) per pair, computed here from the plan;
- each named term of a composite loss gets its own weights and verdict: an NLL term per
  microbatch reads exactly A times too loud while the policy-gradient term and the total read
  invariant, and the command exits 1; with every term over the global count all are invariant;
- every catalogue entry (``sft_conventions``, ``dpo_conventions``, ``composite_conventions``, and
  the DAPO window of ``conventions``) gets the verdict its formula implies, each reason below;
- a loss for the wrong objective, a non-scalar, no gradient, a term that is not a tensor, flags an
  objective cannot take: one ``error:`` line, exit 2, naming what to change.
"""

import math
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.helpers.audit_command import run, verdict_of
from torch.testing import assert_close

from gradnorm import dpo_losses, pair_weights, sft_weights
from gradnorm.audit import (
    audit,
    composite_conventions,
    conventions,
    dpo_conventions,
    sft_conventions,
)
from gradnorm.audit.cli import main
from gradnorm.audit.splits import Splits

SPLITS = dict(world_sizes=(2, 3), accum_steps=(1, 2), splits=Splits(microbatch_tokens=160))


# ------------------------------------------------------------------ SFT: the weights read exactly


def _sft_loss(mode):
    def loss(logp, mask, *, num_tokens, num_sequences, world_size, accum_steps):
        w = sft_weights(mask, mode, world_size=world_size, accum_steps=accum_steps, num_tokens=num_tokens,
                        num_sequences=num_sequences, dtype=logp.dtype)
        return -(world_size * w * torch.where(mask, logp, 0.0)).sum()
    return loss


@pytest.mark.parametrize("mode", ["token", "sequence", "local", "4096"])
def test_an_sft_loss_from_the_library_reads_as_its_own_mode(mode):
    report = audit(_sft_loss(mode), objective="sft", **SPLITS)
    expected = "constant" if mode == "4096" else mode
    assert report.equals == expected and not report.wrong_sign and not report.leaks
    assert report.invariant == (mode != "local")
    mask = report.batch.mask.double()
    longhand = {"token": mask / mask.sum(), "sequence": mask / (mask.sum(-1, keepdim=True) * len(mask)),
                "4096": mask / 4096}
    for result in report.results:
        if mode in longhand:
            assert_close(result.weights, longhand[mode], rtol=1e-12, atol=0)
        else:  # local: 1 / (W * A_r * n[r, m]) on each microbatch's label tokens
            for rank in result.plan:
                for mb in rank:
                    assert_close(result.weights[mb], mask[mb] / (len(result.plan) * len(rank) * mask[mb].sum()),
                                 rtol=1e-12, atol=0)


def test_control_a_wrong_sft_weight_is_named_by_no_mode():
    def every_other_twice(logp, mask, *, num_tokens, world_size, sequence_ids):
        odd = (sequence_ids % 2 == 1).to(logp.dtype)  # rows of odd sequences weigh 2/N: a weight no mode gives
        return -((1 + odd) * torch.where(mask, logp, 0.0)).sum() / num_tokens * world_size
    report = audit(every_other_twice, objective="sft", world_sizes=(2,), accum_steps=(1,), shardings=("contiguous",))
    assert report.invariant and report.equals is None and report.near is None
    assert report.distance["token"] == pytest.approx(1.0)


# ------------------------------------------------------------------ DPO: the pair weights read exactly


def _dpo_loss(mode, length_normalized):
    def loss(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, chosen_mask, rejected_mask, *,
             num_pairs, world_size, accum_steps, beta):
        losses = dpo_losses(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, chosen_mask,
                            rejected_mask, beta=beta, length_normalized=length_normalized)
        v = pair_weights(len(losses), mode, world_size=world_size, accum_steps=accum_steps, num_pairs=num_pairs,
                         dtype=losses.dtype)
        return (world_size * v * losses).sum()
    return loss


@pytest.mark.parametrize("length_normalized", [False, True])
@pytest.mark.parametrize("mode", ["pair", "local"])
def test_a_dpo_loss_from_the_library_reads_as_its_own_mode(mode, length_normalized):
    report = audit(_dpo_loss(mode, length_normalized), objective="dpo", **SPLITS)
    assert report.equals == mode + (" normalized" if length_normalized else "")
    assert report.invariant == (mode == "pair") and not report.wrong_sign
    mask = report.batch.mask.double()
    per_token = mask / mask.sum(-1, keepdim=True) if length_normalized else mask
    P = len(mask) // 2
    for result in report.results:
        if mode == "pair":  # every token of pair p weighs v_p = 1/P (over |y| when normalized)
            assert_close(result.weights, per_token / P, rtol=1e-12, atol=0)
        else:
            for rank in result.plan:
                for mb in rank:
                    assert (mb.view(-1, 2)[:, 1] == mb.view(-1, 2)[:, 0] + 1).all()  # a pair is never cut
                    expected = per_token[mb] / (len(result.plan) * len(rank) * (len(mb) // 2))
                    assert_close(result.weights[mb], expected, rtol=1e-12, atol=0)
    budgets = [r for r in report.results if "budget" in r.axes]
    assert budgets and any(not r.equal_counts for r in budgets)  # the budget made pair counts differ


def test_a_dpo_loss_with_chosen_and_rejected_swapped_is_wrong_signed():
    def swapped(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, chosen_mask, rejected_mask, *,
                num_pairs, world_size, beta):
        return dpo_losses(rejected_logp, chosen_logp, ref_rejected_logp, ref_chosen_logp, rejected_mask,
                          chosen_mask, beta=beta).sum() / num_pairs * world_size
    report = audit(swapped, objective="dpo", world_sizes=(2,), accum_steps=(2,))
    assert report.wrong_sign and report.negative == pytest.approx(1.0) and report.exit_code == 1


def test_a_dpo_loss_read_with_another_beta_is_a_uniform_factor_and_the_verdict_asks_about_beta(capsys):
    code, out, _ = run(capsys, "gradnorm.audit.dpo_conventions:pair_sum_over_global_pairs", "--objective", "dpo",
                       "--beta", "0.5", "--world-size", "2")
    assert code == 0 and "equals gradnorm's `pair`" in out  # it asks for beta: read at its own
    report = audit(dpo_conventions.simpo_pair_mean_per_microbatch, objective="dpo", world_sizes=(2,),
                   accum_steps=(2,), shardings=("interleave",))
    sigmoid = 1 / (1 + math.exp(-dpo_conventions.SIMPO_GAMMA))
    assert report.near.mode == "pair normalized"  # equal pair counts: local normalized is the same weights
    assert report.near.scale == pytest.approx(2 * sigmoid * dpo_conventions.SIMPO_BETA / 0.1, rel=1e-9)


# ------------------------------------------------------------------ a rank's step


def test_a_step_that_divides_by_g_equals_the_same_loss_written_per_microbatch():
    step = audit(sft_conventions.model_loss_under_accelerate, objective="sft", step=True, **SPLITS)
    loss = audit(sft_conventions.model_drops_loss_kwargs, objective="sft", **SPLITS)
    assert [r.label for r in step.results] == [r.label for r in loss.results]
    for a, b in zip(step.results, loss.results):
        assert_close(a.weights, b.weights, rtol=1e-12, atol=0)
    assert step.equals == "local" and not step.invariant

    def forgets_g(microbatches):  # the control: the loop's division left out
        for mb in microbatches:
            (-(torch.where(mb["mask"], mb["logp"], 0.0).sum() / mb["mask"].sum())).backward()
    control = audit(forgets_g, objective="sft", step=True, world_sizes=(2,), accum_steps=(3,),
                    shardings=("interleave",))
    assert control.equals is None and control.near.mode == "local" and control.near.powers == ((0, 1),)


def test_olmo_cores_token_share_reads_exactly_as_its_formula():
    report = audit(dpo_conventions.token_share_of_pair_means, objective="dpo", step=True, world_sizes=(2, 4),
                   accum_steps=(2,))
    mask = report.batch.mask
    for result in report.results:
        W = len(result.plan)
        for rank in result.plan:
            T_rank = int(mask[torch.cat(rank)].sum())
            for mb in rank:
                share = int(mask[mb].sum()) / T_rank
                expected = mask[mb].double() * share / ((len(mb) // 2) * W)  # T_mb / (T_r * P[r, m] * W)
                assert_close(result.weights[mb], expected, rtol=1e-12, atol=0)
    assert report.equals is None and not report.invariant
    assert max(r.change for r in report.results if r.equal_counts) > 0.1  # skewed with equal pair counts too


# ------------------------------------------------------------------ composite losses, term by term


def test_the_nll_term_per_microbatch_is_a_times_too_loud_and_alone_in_its_verdict(capsys):
    report = audit(composite_conventions.nll_term_per_microbatch, world_sizes=(2,), accum_steps=(32,),
                   shardings=("interleave",))
    assert set(report.terms) == {"pg", "nll"}
    nll, pg = report.terms["nll"], report.terms["pg"]
    assert pg.invariant and pg.equals == "token" and report.invariant and report.equals == "token"
    ratio, where = nll.loudness
    assert ratio == pytest.approx(32.0, rel=1e-12) and where.accum_steps == 32
    assert not nll.invariant and report.exit_code == 1
    code, out, _ = run(capsys, "gradnorm.audit.composite_conventions:nll_term_per_microbatch",
                       *composite_conventions.FLAGS["nll_term_per_microbatch"])
    lines = out.splitlines()
    assert code == 1 and "term 'nll': SKEWED" in out and "32x too loud at W=2 A=32" in out
    assert [line for line in lines if line.startswith("term 'pg'")][0].startswith("term 'pg': INVARIANT")
    assert verdict_of(out).startswith("verdict: SKEWED in term 'nll': 32x too loud")


def test_control_every_term_over_the_global_count_is_invariant_term_by_term():
    report = audit(composite_conventions.every_term_over_global, world_sizes=(2,), accum_steps=(4,))
    assert set(report.terms) == {"pg", "kl", "nll"} and report.exit_code == 0
    assert all(t.invariant for t in report.terms.values())
    assert report.terms["pg"].equals == "token"
    kl, nll = report.terms["kl"], report.terms["nll"]
    assert nll.near.mode == "token" and nll.near.scale == pytest.approx(composite_conventions.NLL_COEF, rel=1e-9)
    # k3's slope at ref_logp = logp - 0.1 is 1 - exp(-0.1), pushing logp down: a negative weight on -log p
    assert kl.near.mode == "token"
    assert kl.near.scale == pytest.approx(-composite_conventions.KL_COEF * (1 - math.exp(-0.1)), rel=1e-9)


# ------------------------------------------------------------------ the catalogue


CATALOGUE = {  # (module, name): (exit, what the verdict must say), from each formula
    # 1 / (G W n[r, m]): the microbatch's token mean is `local` under every split
    ("sft_conventions", "model_loss_under_accelerate"): (1, "equals gradnorm's `local`"),
    ("sft_conventions", "model_drops_loss_kwargs"): (1, "equals gradnorm's `local`"),
    ("sft_conventions", "token_sum_over_num_items"): (0, "equals gradnorm's `token`"),  # 1 / N
    ("sft_conventions", "sequence_mean_over_sequences"): (0, "equals gradnorm's `sequence`"),  # 1 / (S |y|)
    ("sft_conventions", "token_sum"): (0, "equals a constant denominator C = 1"),
    # 1 / (G W P[r, m]): exact while every microbatch holds the same pairs; the budget breaks that
    ("dpo_conventions", "pair_mean_per_microbatch"):
        (1, "invariant whenever every microbatch holds the same number of pairs, where it equals gradnorm's `pair`"),
    ("dpo_conventions", "token_share_of_pair_means"): (1, "equals no gradnorm mode"),  # T_mb / (T_r P W)
    ("dpo_conventions", "pair_sum_over_global_pairs"): (0, "equals gradnorm's `pair`"),  # 1 / P
    ("dpo_conventions", "normalized_pair_mean_per_microbatch"):
        (1, "where it equals gradnorm's `pair normalized`"),
    ("dpo_conventions", "simpo_pair_mean_per_microbatch"):
        (1, "equals gradnorm's `local normalized` up to a factor 29.24"),  # 2 sigmoid(1) * 2 / 0.1
    ("composite_conventions", "nll_term_per_microbatch"): (1, "SKEWED in term 'nll': 32x too loud"),
    ("composite_conventions", "every_term_over_global"): (0, "equals gradnorm's `token`"),
    # A / (S_gen N): the step's weights sum to A / S_gen, a factor A against one process
    ("conventions", "dapo_generation_window_count"): (1, "up to a factor A"),
}
MODULES = {"sft_conventions": sft_conventions, "dpo_conventions": dpo_conventions,
           "composite_conventions": composite_conventions, "conventions": conventions}


def test_the_catalogue_above_is_every_post_training_entry():
    listed = {(m, n) for m, n in CATALOGUE}
    for module in ("sft_conventions", "dpo_conventions", "composite_conventions"):
        assert {(module, n) for n in MODULES[module].CATALOGUE} <= listed
        assert set(MODULES[module].FLAGS) == set(MODULES[module].CATALOGUE)


@pytest.mark.parametrize(("module", "name"), list(CATALOGUE))
def test_each_catalogue_entry_gets_the_verdict_its_formula_implies(module, name, capsys):
    flags = MODULES[module].FLAGS[name] if module != "conventions" else conventions.AXES[name]
    code, out, err = run(capsys, f"gradnorm.audit.{module}:{name}", *flags)
    expected_code, says = CATALOGUE[(module, name)]
    assert err == "" and code == expected_code, (code, err, out)
    assert says in verdict_of(out), verdict_of(out)


def test_the_dapo_window_weighs_a_over_s_gen_times_the_fix():
    report = audit(conventions.dapo_generation_window_count, world_sizes=(2,), accum_steps=(2, 4, 8),
                   shardings=("interleave",))
    mask = report.batch.mask.double()
    for result in report.results:
        ratio = result.accum_steps / conventions.STEPS_PER_GENERATION
        assert_close(result.weights, ratio * mask / mask.sum(), rtol=1e-12, atol=0)
    exact = [r for r in report.results if r.accum_steps == conventions.STEPS_PER_GENERATION]
    assert exact and all(r.distance["token"] < 1e-12 for r in exact)  # A = S_gen: exactly the fix's weights


# ------------------------------------------------------------------ bad input: one line, exit 2


BAD = {
    "an SFT loss audited as GRPO": (["gradnorm.audit.sft_conventions:token_sum"], "cannot take the audit's arguments"),
    "a GRPO loss audited as SFT": (["gradnorm.audit.conventions:microbatch_token_mean", "--objective", "sft"],
                                   "LOSS(logp, mask, **counts)"),
    "a DPO loss audited as SFT": (["gradnorm.audit.dpo_conventions:pair_mean_per_microbatch", "--objective", "sft"],
                                  "cannot take the audit's arguments"),
    "DPO with packing": (["gradnorm.audit.dpo_conventions:pair_sum_over_global_pairs", "--objective", "dpo",
                          "--pack", "128"], "packing, context parallelism and pipelines are not simulated for pairs"),
    "SFT with masked tokens": (["gradnorm.audit.sft_conventions:token_sum", "--objective", "sft",
                                "--count-masked", "none"], "an SFT audit takes none"),
    "beta of 0": (["gradnorm.audit.sft_conventions:token_sum", "--objective", "dpo", "--beta", "0"],
                  "expected a positive number"),
    "beta nan": (["gradnorm.audit.sft_conventions:token_sum", "--objective", "dpo", "--beta", "nan"],
                 "expected a positive number"),
    "a step with --scale-by-accum": (["gradnorm.audit.sft_conventions:model_loss_under_accelerate", "--objective",
                                      "sft", "--step", "--scale-by-accum"], "a step applies its own scaling"),
    "a step under context parallelism": (["gradnorm.audit.sft_conventions:model_loss_under_accelerate",
                                          "--objective", "sft", "--step", "--context-parallel", "2"],
                                         "context parallelism and pipelines need a microbatch loss"),
    "a microbatch loss given as a step": (["gradnorm.audit.sft_conventions:token_sum", "--objective", "sft",
                                           "--step"], "the step cannot take the audit's arguments"),
    "an unknown objective": (["gradnorm.audit.sft_conventions:token_sum", "--objective", "ppo"], "invalid choice"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_flags_and_losses_an_objective_cannot_take_are_one_error_line(case, capsys):
    argv, says = BAD[case]
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert says in err, err


def _nonscalar(logp, mask):
    return torch.where(mask, -logp, 0.0).sum(-1)


def _no_gradient(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, chosen_mask, rejected_mask):
    return torch.zeros((), dtype=chosen_logp.dtype)


def _term_not_a_tensor(logp, old_logp, advantages, mask):
    return {"pg": -(logp * advantages.unsqueeze(-1) * mask).sum(), "kl": 0.5}


def _terms_that_change(logp, old_logp, advantages, mask):
    pg = -(logp * advantages.unsqueeze(-1) * mask).sum()
    _terms_that_change.calls = getattr(_terms_that_change, "calls", 0) + 1
    return {"pg": pg} if _terms_that_change.calls % 2 else {"pg": pg, "nll": -(logp * mask).sum()}


def _no_backward(microbatches):
    for mb in microbatches:
        torch.where(mb["mask"], -mb["logp"], 0.0).sum()


@pytest.mark.parametrize(("fn", "objective", "says"), [
    (_nonscalar, "sft", "the loss must be a scalar float tensor, got shape"),
    (_no_gradient, "dpo", "the loss is not differentiable in logp (no gradient)"),
    (_term_not_a_tensor, "grpo", "the loss's term 'kl' must be a scalar float tensor, got float"),
    (_terms_that_change, "grpo", "every call must return the same terms"),
])
def test_a_broken_loss_for_each_objective_is_a_contract_error(fn, objective, says):
    from gradnorm.audit import ContractError
    with pytest.raises(ContractError) as err:
        audit(fn, objective=objective, world_sizes=(3,), accum_steps=(1,), shardings=("interleave",))
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_step_that_calls_no_backward_is_a_contract_error():
    from gradnorm.audit import ContractError
    with pytest.raises(ContractError, match="called no backward that reaches logp"):
        audit(_no_backward, objective="sft", step=True, world_sizes=(2,), accum_steps=(2,))


def test_help_says_how_to_choose_the_objective(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    for needle in ("--objective {grpo,sft,dpo}", "--objective sft", "LOSS(logp, mask, **counts)",
                   "LOSS(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, chosen_mask, rejected_mask",
                   "--step: LOSS is instead a rank's step", "dict of named scalar terms"):
        assert needle in " ".join(out.split()) or needle in out, needle


def test_the_docs_show_what_each_sft_dpo_and_composite_command_prints(capsys):
    doc = (Path(__file__).resolve().parents[3] / "docs" / "audit.md").read_text()
    section = doc[doc.index("## SFT, DPO, your own loop"):doc.index("## What the audit can and cannot see")]
    runs = re.findall(r"```bash\n\.venv/bin/python -m gradnorm\.audit (.*?)\n```\n\n```text\n(.*?)```", section, re.S)
    assert len(runs) == 3
    for argv, printed in runs:
        code, out, err = run(capsys, *shlex.split(argv))
        assert code == 1 and err == "" and out == printed, argv


def test_sft_losses_under_packed_rows_and_context_parallelism(capsys):
    packed = Splits(pack=256)
    fix = audit(sft_conventions.token_sum_over_num_items, objective="sft", world_sizes=(2,), splits=packed)
    old = audit(sft_conventions.model_drops_loss_kwargs, objective="sft", world_sizes=(2,), splits=packed)
    assert fix.invariant and fix.equals == "token" and any("pack" in r.axes for r in fix.results)
    assert not old.invariant and old.equals == "local"  # the control
    code, out, _ = run(capsys, "gradnorm.audit.sft_conventions:token_sum_over_num_items", "--objective", "sft",
                       "--context-parallel", "2", "--world-size", "2")
    assert code == 1 and "every weight is divided by K = 2" in verdict_of(out)  # it does not multiply by K


def test_the_weight_map_draws_a_dpo_result():
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from gradnorm.audit import plot as auditplot

    report = audit(dpo_conventions.pair_mean_per_microbatch, objective="dpo", world_sizes=(2,), accum_steps=(2,),
                   shardings=("length",))
    result = report.results[-1]
    ax_map, ax_share = Figure().subplots(1, 2)
    image = auditplot.plot_weight_map(ax_map, report.batch, result)
    sequence, _, _ = auditplot.plan_rows(result)
    drawn = np.ma.filled(image.get_array(), np.nan)
    expected = (result.weights[sequence] * report.batch.mask.sum()).numpy()
    counted = report.batch.mask[sequence].numpy()
    assert np.allclose(drawn[counted], expected[counted], rtol=1e-9, atol=0)
    assert int(np.isfinite(drawn).sum()) == int(counted.sum())  # padding blank
    bars = auditplot.plot_rank_shares(ax_share, result)
    assert [b.get_height() for b in bars["update"]] == pytest.approx(result.update_share.tolist())
