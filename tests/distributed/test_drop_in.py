"""The fix as a drop-in: examples/drop_in_ddp.py, the lines the README shows, in a plain DDP loop.

What must hold:
- the README's block under "Use the fix in your own loop" is, line for line, the section of
  examples/drop_in_ddp.py between its ``drop-in`` markers (what a reader copies is what is tested);
- ``gradnorm.audit`` finds the example's ``grpo_loss`` INVARIANT for every fixed mode (``token``,
  ``sequence``, ``group``, a constant C) and equal to that mode's weights, called exactly as the
  audit calls any loss; the controls, the same loss with ``local`` and the old per-microbatch
  mean written out, are SKEWED;
- on 2 real gloo ranks x 2 microbatches, ranks sorted by response length, the example's
  ``accumulate`` under DDP gives the gradient of J for each fixed mode, against a one-process
  oracle written out longhand, with ONE collective per step besides DDP's own; ``local`` differs;
- ``loss_weights`` from ``Counts.for_microbatch`` equals ``token_weights`` from the counts.
"""

import functools
import re
from pathlib import Path

import drop_in_ddp as example  # examples/ is on sys.path (tests/conftest.py)
import pytest
import torch
from torch.testing import assert_close

import gradnorm
from gradnorm.audit import audit
from gradnorm.audit.verdict import verdict
from gradnorm.dist.spawn import count_collectives, spawn_gloo

ROOT = Path(__file__).resolve().parents[2]
FIXED = ["token", "sequence", "group", "4096"]  # 4096: a constant C (Dr GRPO)
W, A, GROUPS = 2, 2, 4


def test_the_readme_shows_exactly_the_examples_drop_in_section():
    source = (ROOT / "examples" / "drop_in_ddp.py").read_text()
    section = re.search(r"# --- drop-in: begin[^\n]*\n(.*?)# --- drop-in: end ---\n", source, re.S).group(1)
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- drop-in: examples/drop_in_ddp.py[^\n]*-->\n\n```python\n(.*?)```\n", readme, re.S).group(1)
    assert block == section
    assert section.count("dist.all_reduce") == 1 and "no_sync" in section and ".backward()" in section


# ------------------------------------------------------------------ the audit


@pytest.mark.parametrize("mode", FIXED)
def test_the_audit_finds_the_examples_loss_invariant_in_every_fixed_mode(mode):
    report = audit(functools.partial(example.grpo_loss, denominator=mode), world_sizes=(2, 8), accum_steps=(1, 4))
    assert verdict(report).startswith("INVARIANT"), verdict(report)
    assert report.invariant and not report.leaks and not report.wrong_sign
    assert report.equals == ("constant" if mode == "4096" else mode)


def old_per_microbatch_mean(logp, old_logp, advantages, mask, *, accum_steps):
    """The control: the same clipped surrogate, averaged over the microbatch's own tokens, divided by A."""
    ratio, adv = torch.exp(logp - old_logp), advantages.unsqueeze(-1)
    l = -torch.min(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
    return torch.where(mask, l, 0.0).sum() / mask.sum().clamp(min=1) / accum_steps


@pytest.mark.parametrize("loss", [functools.partial(example.grpo_loss, denominator="local"), old_per_microbatch_mean],
                         ids=["example-local", "old-mean"])
def test_control_the_per_microbatch_mean_is_skewed(loss):
    report = audit(loss, world_sizes=(2, 8), accum_steps=(1, 4))
    assert verdict(report).startswith("SKEWED"), verdict(report)
    assert not report.invariant and report.equals == "local"


def test_loss_weights_from_the_microbatch_counts_are_token_weights():
    batch = example.toy_minibatch(example.toy_policy())
    lengths = batch["mask"].sum(-1)
    counts = gradnorm.Counts.from_vector(gradnorm.count_tokens(lengths, batch["group_ids"], GROUPS))
    for mb in example.microbatches_of(batch, 0, W, A):
        for mode in ["local", *FIXED]:
            by_name = gradnorm.loss_weights(mb["mask"], mode, **counts.for_microbatch(mb["group_ids"]),
                                            world_size=W, accum_steps=A)
            expected = gradnorm.token_weights(mb["mask"], mb["group_ids"], gradnorm.parse_denominator(mode), counts,
                                              world_size=W, accum_steps=A)
            assert torch.equal(by_name, expected), mode
    with pytest.raises(ValueError, match="'group' needs num_groups and group_tokens"):
        gradnorm.loss_weights(batch["mask"], "group", world_size=1)


# ------------------------------------------------------------------ 2 gloo ranks against the oracle


def ranks_gradients(ctx, modes):
    """One rank of the example: for each mode, ``accumulate`` under DDP and the reduced gradient."""
    model = example.toy_policy()
    batch = example.toy_minibatch(model)
    ddp_model = torch.nn.parallel.DistributedDataParallel(model)
    microbatches = example.microbatches_of(batch, ctx.rank, ctx.world_size, A)
    grads, collectives, tokens = {}, {}, [int(mb["mask"].sum()) for mb in microbatches]
    for mode in modes:
        model.zero_grad(set_to_none=True)
        with count_collectives() as calls:
            example.accumulate(ddp_model, microbatches, GROUPS, denominator=mode)
        grads[mode] = torch.cat([p.grad.flatten() for p in model.parameters()])
        collectives[mode] = calls["n"]
    return {"grads": grads, "collectives": collectives, "tokens": tokens}


def oracle_gradient(mode: str) -> torch.Tensor:
    """dJ/dtheta in one process over the whole minibatch, each mode's J written out longhand."""
    model = example.toy_policy()
    batch = example.toy_minibatch(model)
    mask, groups = batch["mask"], batch["group_ids"]
    ratio = torch.exp(example.token_logprobs(model, batch["tokens"]) - batch["old_logp"])
    adv = batch["advantages"].unsqueeze(-1)
    l = torch.where(mask, -torch.min(ratio * adv, ratio.clamp(0.8, 1.28) * adv), 0.0)  # (S, T)
    per_sequence = l.sum(-1)  # (S,)
    if mode == "token":
        J = l.sum() / mask.sum()
    elif mode == "sequence":
        has = mask.sum(-1) > 0
        J = (per_sequence[has] / mask.sum(-1)[has]).sum() / has.sum()
    elif mode == "group":
        group_tokens = torch.zeros(GROUPS, dtype=torch.long).index_add_(0, groups, mask.sum(-1))
        group_sums = torch.zeros(GROUPS, dtype=l.dtype).index_add(0, groups, per_sequence)
        live = group_tokens > 0
        J = (group_sums[live] / group_tokens[live]).sum() / live.sum()
    else:
        J = l.sum() / float(mode)
    J.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.fixture(scope="module")
def two_ranks():
    return spawn_gloo(ranks_gradients, W, ["local", *FIXED])


@pytest.mark.launch
@pytest.mark.parametrize("mode", FIXED)
def test_two_gloo_ranks_give_the_one_process_gradient_with_one_all_reduce(two_ranks, mode):
    expected = oracle_gradient(mode)
    for rank in two_ranks:  # DDP leaves the same gradient on every rank
        assert_close(rank["grads"][mode], expected, rtol=1e-10, atol=1e-13)
        assert rank["collectives"][mode] == 1


@pytest.mark.launch
def test_control_local_differs_when_microbatch_token_counts_differ(two_ranks):
    counts = [n for rank in two_ranks for n in rank["tokens"]]
    assert max(counts) > 3 * min(counts), counts  # sorting by length made the microbatches ragged
    local, token = two_ranks[0]["grads"]["local"], oracle_gradient("token")
    assert (local - token).norm() > 0.1 * token.norm()
