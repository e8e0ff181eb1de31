"""SFT and DPO as drop-ins: examples/drop_in_sft.py and examples/drop_in_dpo.py in a plain DDP loop.

What must hold, for each example as tests/distributed/test_drop_in.py holds it for GRPO's:
- ``gradnorm.audit`` finds the example's loss INVARIANT in every fixed mode and equal to that
  mode's weights (SFT: ``token``, ``sequence``, a constant C; DPO: ``pair``, length-normalized or
  not, and a constant C), called exactly as the audit calls any loss; the controls, ``local`` and
  the old per-microbatch mean written out (``outputs.loss / A``, ``losses.mean() / A``), are SKEWED;
- on 2 real gloo ranks x 2 microbatches with unequal label (SFT) and pair (DPO) counts, the
  example's ``accumulate`` under DDP gives the gradient of J for each fixed mode, against a
  one-process fp64 oracle written out longhand, to 1e-10, with ONE collective per step besides
  DDP's own; ``local`` differs from it;
- each example's docstring commands are what the README names.
"""

import functools
import re
from pathlib import Path

import drop_in_dpo as dpo  # examples/ is on sys.path (tests/conftest.py)
import drop_in_sft as sft
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from gradnorm.audit import audit
from gradnorm.audit.verdict import verdict
from gradnorm.dist.spawn import count_collectives, spawn_gloo

ROOT = Path(__file__).resolve().parents[2]
W, A = 2, 2
SPLITS = {"world_sizes": (2, 8), "accum_steps": (1, 4)}
SFT_FIXED = ["token", "sequence", "4096"]  # 4096: a constant C
DPO_FIXED = [("pair", False), ("pair", True), ("64", False)]  # (denominator, length_normalized)
BETA = 0.1


def flat_grad(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


# ------------------------------------------------------------------ the audit


@pytest.mark.parametrize("mode", SFT_FIXED)
def test_the_audit_finds_the_sft_examples_loss_invariant_in_every_fixed_mode(mode):
    report = audit(functools.partial(sft.sft_loss, denominator=mode), objective="sft", **SPLITS)
    assert verdict(report).startswith("INVARIANT"), verdict(report)
    assert report.invariant and not report.leaks and not report.wrong_sign
    assert report.equals == ("constant" if mode == "4096" else mode)


@pytest.mark.parametrize("denominator, normalized", DPO_FIXED, ids=["pair", "pair-normalized", "constant"])
def test_the_audit_finds_the_dpo_examples_loss_invariant_in_every_fixed_mode(denominator, normalized):
    loss = functools.partial(dpo.dpo_loss, denominator=denominator, length_normalized=normalized)
    report = audit(loss, objective="dpo", **SPLITS)
    assert verdict(report).startswith("INVARIANT"), verdict(report)
    assert report.invariant and not report.leaks and not report.wrong_sign
    if denominator == "pair":
        assert report.equals == ("pair normalized" if normalized else "pair")


def outputs_loss_over_a(logp, mask, *, accum_steps):
    """The SFT control: a model's ``outputs.loss`` (the microbatch's label-token mean) divided by A."""
    return -torch.where(mask, logp, 0.0).sum() / mask.sum().clamp(min=1) / accum_steps


def pair_mean_over_a(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, chosen_mask, rejected_mask, *,
                     accum_steps, beta):
    """The DPO control: ``losses.mean()`` over the microbatch's own pairs, divided by A."""
    return dpo.dpo_losses(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, chosen_mask,
                          rejected_mask, beta=beta).mean() / accum_steps


@pytest.mark.parametrize("objective, loss", [
    ("sft", functools.partial(sft.sft_loss, denominator="local")),
    ("sft", outputs_loss_over_a),
    ("dpo", functools.partial(dpo.dpo_loss, denominator="local")),
    ("dpo", pair_mean_over_a),
], ids=["sft-local", "sft-outputs-loss", "dpo-local", "dpo-losses-mean"])
def test_control_the_per_microbatch_mean_is_skewed(objective, loss):
    report = audit(loss, objective=objective, **SPLITS)
    assert verdict(report).startswith("SKEWED"), verdict(report)
    assert not report.invariant and report.equals == "local"


# ------------------------------------------------------------------ 2 gloo ranks against the oracle


def ranks_gradients(ctx):
    """One rank of each example: for each mode, ``accumulate`` under DDP and the reduced gradient."""
    out = {"sft": {}, "dpo": {}, "collectives": {}, "labels": [], "pairs": []}
    model = sft.toy_policy()
    ddp_model = torch.nn.parallel.DistributedDataParallel(model)
    microbatches = sft.microbatches_of(sft.toy_sft_batch(), ctx.rank, ctx.world_size, A)
    out["labels"] = [int((mb["labels"] != sft.IGNORE_INDEX).sum()) for mb in microbatches]
    for mode in ["local", *SFT_FIXED]:
        model.zero_grad(set_to_none=True)
        with count_collectives() as calls:
            sft.accumulate(ddp_model, microbatches, denominator=mode)
        out["sft"][mode], out["collectives"][f"sft {mode}"] = flat_grad(model), calls["n"]

    model, ref_model = dpo.toy_policy(), dpo.toy_policy(seed=1)
    ddp_model = torch.nn.parallel.DistributedDataParallel(model)
    k = ctx.world_size * A
    microbatches = dpo.microbatches_of(dpo.toy_pairs(k * (k + 1) // 2), ctx.rank, ctx.world_size, A)
    out["pairs"] = [len(mb["chosen"]) for mb in microbatches]
    for denominator, normalized in [("local", False), *DPO_FIXED]:
        model.zero_grad(set_to_none=True)
        with count_collectives() as calls:
            dpo.accumulate(ddp_model, ref_model, microbatches, denominator=denominator, beta=BETA,
                           length_normalized=normalized)
        key = (denominator, normalized)
        out["dpo"][key], out["collectives"][f"dpo {key}"] = flat_grad(model), calls["n"]
    return out


def sft_oracle(mode: str) -> torch.Tensor:
    """dJ/dtheta in one process over the whole SFT minibatch, J written out longhand."""
    model, batch = sft.toy_policy(), sft.toy_sft_batch()
    logits, labels = model(batch["inputs"]), batch["labels"]  # (S, T, V), (S, T)
    mask = labels != sft.IGNORE_INDEX
    logp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    nll = torch.where(mask, -logp, 0.0)  # (S, T)
    if mode == "token":
        J = nll.sum() / mask.sum()
    elif mode == "sequence":
        has = mask.sum(-1) > 0
        J = (nll.sum(-1)[has] / mask.sum(-1)[has]).sum() / has.sum()
    else:
        J = nll.sum() / float(mode)
    J.backward()
    return flat_grad(model)


def dpo_oracle(denominator: str, normalized: bool) -> torch.Tensor:
    """dJ/dtheta in one process over every pair, J = sum_p v_p * -log sigmoid(beta * m_p) longhand."""
    model, ref_model = dpo.toy_policy(), dpo.toy_policy(seed=1)
    k = W * A
    batch = dpo.toy_pairs(k * (k + 1) // 2)

    def log_pi(policy, side):  # log pi(y) per response: summed (or mean) token log-probs
        tokens, mask = batch[side], batch[f"{side}_mask"]
        logp = torch.log_softmax(policy(tokens[:, :-1]), -1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
        total = (logp * mask).sum(-1)
        return total / mask.sum(-1) if normalized else total

    with torch.no_grad():
        ref_chosen, ref_rejected = log_pi(ref_model, "chosen"), log_pi(ref_model, "rejected")
    margin = (log_pi(model, "chosen") - ref_chosen) - (log_pi(model, "rejected") - ref_rejected)
    losses = -F.logsigmoid(BETA * margin)  # (P,)
    J = losses.mean() if denominator == "pair" else losses.sum() / float(denominator)
    J.backward()
    return flat_grad(model)


@pytest.fixture(scope="module")
def two_ranks():
    return spawn_gloo(ranks_gradients, W)


@pytest.mark.launch
@pytest.mark.parametrize("mode", SFT_FIXED)
def test_sft_on_two_gloo_ranks_gives_the_one_process_gradient_with_one_all_reduce(two_ranks, mode):
    expected = sft_oracle(mode)
    for rank in two_ranks:  # DDP leaves the same gradient on every rank
        assert_close(rank["sft"][mode], expected, rtol=1e-10, atol=1e-13)
        assert rank["collectives"][f"sft {mode}"] == 1


@pytest.mark.launch
@pytest.mark.parametrize("denominator, normalized", DPO_FIXED, ids=["pair", "pair-normalized", "constant"])
def test_dpo_on_two_gloo_ranks_gives_the_one_process_gradient_with_one_all_reduce(two_ranks, denominator, normalized):
    expected = dpo_oracle(denominator, normalized)
    for rank in two_ranks:
        assert_close(rank["dpo"][(denominator, normalized)], expected, rtol=1e-10, atol=1e-13)
        assert rank["collectives"][f"dpo {(denominator, normalized)}"] == 1


@pytest.mark.launch
def test_control_local_differs_when_microbatch_counts_differ(two_ranks):
    labels = [n for rank in two_ranks for n in rank["labels"]]
    assert max(labels) > 3 * min(labels), labels  # sorting by label count made the microbatches ragged
    assert [n for rank in two_ranks for n in rank["pairs"]] == [1, 2, 3, 4]  # the toy token budget
    for got, want in [(two_ranks[0]["sft"]["local"], sft_oracle("token")),
                      (two_ranks[0]["dpo"][("local", False)], dpo_oracle("pair", False))]:
        assert (got - want).norm() > 0.1 * want.norm()


# ------------------------------------------------------------------ what the README and the examples say


@pytest.mark.parametrize("example, loss, objective", [("drop_in_sft.py", "sft_loss", "sft"),
                                                      ("drop_in_dpo.py", "dpo_loss", "dpo")])
def test_the_readme_names_each_example_and_its_audit_command(example, loss, objective):
    source = (ROOT / "examples" / example).read_text()
    command = f"python -m gradnorm.audit examples/{example}:{loss} --objective {objective}"
    assert command in source
    assert command in (ROOT / "README.md").read_text()
    section = re.search(r"# --- drop-in: begin[^\n]*\n(.*?)# --- drop-in: end ---\n", source, re.S).group(1)
    assert section.count("dist.all_reduce") == 1 and "no_sync" in section and ".backward()" in section
