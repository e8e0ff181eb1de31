"""--engine-correction: importance sampling against a rollout engine's log-probs, against a longhand oracle.

The trainer's path for one step (``engine_rollout.check`` -> ``step.Minibatch`` with the
correction's fields -> the trainer's ``step_gradient``: the count all-reduce of ``Minibatch.loss_mask``,
then each microbatch's weighted backward) on TinyGPT, an engine whose log-probs are the trainer's plus noise, and
two microbatches; the oracle is one float64 loop over the tokens with the weights of
tests/helpers/longhand.py over the tokens the correction keeps:

- ``mask`` drops the tokens with rho outside [1/cap, cap] from the loss AND from every count, as
  the audit's ``rejected`` tokens should be (``gradnorm.audit.masking``); the control, the same
  loss with the dropped tokens still counted, is far from the trainer's gradient;
- ``truncate`` multiplies each token's surrogate by min(rho, cap) and counts every token; the
  control, the uncorrected loss, differs.

No vllm is needed: the engine is only its log-probs here. The real engine's runs are in
tests/e2e/test_vllm_rollout.py.
"""

import pytest
import torch
from tests.helpers.longhand import longhand_weights

from gradnorm import train
from gradnorm.core import importance
from gradnorm.core.grpo import clipped_surrogate
from gradnorm.dist import comm
from gradnorm.models.tinygpt import GPTConfig, TinyGPT, response_logprobs
from gradnorm.tasks import RepeatTask
from gradnorm.trainer import engine_rollout, step
from gradnorm.trainer.config import TrainConfig
from gradnorm.trainer.policy import TinyGPTPolicy
from gradnorm.trainer.rollout import generate_rollout

CAP = 1.5
MODES = ["token", "sequence", "group", "local"]


def make_batch():
    """(model, rollout, trainer_logp, engine_logp): an engine 0.4 nats of noise away from the trainer."""
    task = RepeatTask(max_new_tokens=20)
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(task.vocab_size, task.block_size, n_layer=1, n_head=2, n_embd=16)).double()
    rollout = generate_rollout(TinyGPTPolicy(model), task, num_prompts=2, group_size=4, seed=3, step=1, temperature=1.0)
    with torch.no_grad():
        logp = response_logprobs(model, rollout.tokens, rollout.prompt_len)[0]
    g = torch.Generator().manual_seed(1)
    engine_logp = logp + 0.4 * torch.randn(logp.shape, generator=g, dtype=torch.float64)
    return model, rollout, logp, engine_logp


def assert_fp32_close(grad, expected):
    """The trainer scores log-probs in fp32, the oracle in float64: equal to fp32 rounding."""
    assert float((grad - expected).norm() / expected.norm()) < 1e-6


def flat_grad(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def trainer_gradient(model, rollout, trainer_logp, engine_logp, kind, mode):
    """One step of the trainer's code path on one process, two microbatches: (flat gradient, fields)."""
    cfg = TrainConfig(loss_denominator=mode, grad_accum_steps=2, shard="length", clip_low=0.2, clip_high=0.2,
                      rollout_engine="vllm", model="hf-model", engine_correction=kind, engine_ratio_cap=CAP)
    rows = torch.arange(len(rollout.rewards))
    correction, fields = engine_rollout.check(rollout, trainer_logp, engine_logp, rows, kind, CAP)
    batch = step.Minibatch(rollout, None, None, "", **engine_rollout.minibatch_fields(correction, slice(None)))
    plan = step.plan_for(batch, cfg, 1)
    model.zero_grad(set_to_none=True)
    train.step_gradient(model, TinyGPTPolicy(model), batch, plan, cfg, comm.setup(backend=None, device="cpu"),
                        lambda: torch.autocast("cpu", enabled=False))  # the loop's call: counts, then backward
    return flat_grad(model), fields, plan, correction


def oracle_gradient(model, rollout, trainer_logp, engine_logp, kind, mode, plan, count_dropped=False):
    """A float64 loop over tokens: sum_i w_i sum_t c_it * surrogate_it over the kept tokens; w_i from
    tests/helpers/longhand.py over the kept lengths (or every response token: ``count_dropped``, the control)."""
    rho = (trainer_logp - engine_logp).exp()
    kept = rollout.mask.clone()
    factor = torch.ones_like(rho)
    if kind == "mask":
        kept &= (rho <= CAP) & (rho >= 1 / CAP)
    if kind == "truncate":
        factor = rho.clamp(max=CAP)
    counted = rollout.mask if count_dropped else kept
    lengths = [int(n) for n in counted.sum(-1)]
    weights = longhand_weights(mode, lengths, rollout.group_ids.tolist(), plan)
    model.zero_grad(set_to_none=True)
    logp, _ = response_logprobs(model, rollout.tokens, rollout.prompt_len)
    surrogate, _ = clipped_surrogate(logp, logp.detach(), rollout.advantages.double(), 0.2, 0.2)
    total = 0
    for i in range(len(lengths)):
        for t in range(kept.shape[1]):
            if kept[i, t]:
                total = total + weights[i] * factor[i, t] * surrogate[i, t]
    total.backward()
    return flat_grad(model)


@pytest.fixture(scope="module")
def batch():
    return make_batch()


def test_the_noise_moves_some_ratios_past_the_cap_and_leaves_most_inside(batch):
    _, rollout, trainer_logp, engine_logp = batch
    rho = (trainer_logp - engine_logp).exp()[rollout.mask]
    outside = int(((rho > CAP) | (rho < 1 / CAP)).sum())
    assert 0 < outside < rho.numel() // 2, (outside, rho.numel())
    assert int((rho > CAP).sum()) > 0


@pytest.mark.parametrize("mode", MODES)
def test_mask_drops_tokens_from_the_loss_and_from_every_count(batch, mode):
    model, rollout, trainer_logp, engine_logp = batch
    grad, fields, plan, correction = trainer_gradient(model, rollout, trainer_logp, engine_logp, "mask", mode)
    assert_fp32_close(grad, oracle_gradient(model, rollout, trainer_logp, engine_logp, "mask", mode, plan))
    assert fields["engine_dropped_tokens"] == int(correction.dropped.sum()) > 0
    # the control: the dropped tokens left out of the sum but still counted in the denominators
    leaky = oracle_gradient(model, rollout, trainer_logp, engine_logp, "mask", mode, plan, count_dropped=True)
    assert (grad - leaky).norm() > 0.1 * grad.norm()


@pytest.mark.parametrize("mode", MODES)
def test_truncate_caps_each_tokens_ratio_and_counts_every_token(batch, mode):
    model, rollout, trainer_logp, engine_logp = batch
    grad, fields, plan, _ = trainer_gradient(model, rollout, trainer_logp, engine_logp, "truncate", mode)
    assert_fp32_close(grad, oracle_gradient(model, rollout, trainer_logp, engine_logp, "truncate", mode, plan))
    assert fields["engine_capped_tokens"] > 0
    # the control: no correction is another gradient
    plain, _, _, _ = trainer_gradient(model, rollout, trainer_logp, engine_logp, "none", mode)
    assert (grad - plain).norm() > 1e-2 * grad.norm()


def test_no_correction_is_the_plain_loss_and_the_fields_measure_the_gap(batch):
    model, rollout, trainer_logp, engine_logp = batch
    grad, fields, plan, correction = trainer_gradient(model, rollout, trainer_logp, engine_logp, "none", "token")
    assert_fp32_close(grad, oracle_gradient(model, rollout, trainer_logp, engine_logp, "none", "token", plan))
    diff = (trainer_logp - engine_logp)[rollout.mask]
    assert fields["engine_logp_absdiff_max"] == pytest.approx(float(diff.abs().max()))
    assert fields["engine_logp_absdiff_mean"] == pytest.approx(float(diff.abs().mean()))
    assert fields["engine_ratio_min"] == pytest.approx(float(diff.exp().min()))
    assert fields["engine_ratio_max"] == pytest.approx(float(diff.exp().max()))
    assert "engine_dropped_tokens" not in fields and "engine_capped_tokens" not in fields
    assert correction.weight is None and torch.equal(correction.kept, rollout.mask)


def test_a_rank_checks_only_its_own_rows(batch):
    _, rollout, trainer_logp, engine_logp = batch
    mine = torch.tensor([0, 3, 5])
    correction, fields = engine_rollout.check(rollout, trainer_logp, engine_logp, mine, "mask", CAP)
    others = torch.ones(len(rollout.rewards), dtype=torch.bool)
    others[mine] = False
    assert not correction.kept[others].any() and not correction.dropped[others].any()
    diff = (trainer_logp - engine_logp)[mine][rollout.mask[mine]]
    assert fields["engine_logp_absdiff_max"] == pytest.approx(float(diff.abs().max()))


def test_bad_corrections_are_refused():
    logp = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="unknown correction"):
        importance.correct(logp, logp, mask, "clip", 2.0)
    with pytest.raises(ValueError, match="above 1"):
        importance.correct(logp, logp, mask, "mask", 1.0)
    with pytest.raises(ValueError, match="needs --rollout-engine vllm"):
        TrainConfig(engine_correction="mask", model="hf-model").validate()
    TrainConfig(engine_correction="mask", model="hf-model", rollout_engine="vllm").validate()  # the control
