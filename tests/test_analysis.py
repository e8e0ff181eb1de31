"""The numbers behind the notebooks, against values worked out by hand.

Every view in ``gradnorm.analysis`` is checked on a case small enough to do on paper, and each
comes with a control that must fail: ``local`` must differ from ``token`` when microbatch token
counts are ragged and agree with it when they are balanced, so a test that cannot fail would show.
"""

import json
from fractions import Fraction

import numpy as np
import pytest
import torch
from numpy.testing import assert_allclose

from gradnorm import analysis
from gradnorm.sharding import make_plan


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


def fractions(weights):
    return [Fraction(float(w)).limit_denominator(10_000) for w in weights]


# ------------------------------------------------------------------ 1. token imbalance


def test_imbalanced_minibatch_layout():
    batch = analysis.imbalanced_minibatch(world_size=2, accum_steps=2, imbalance=4, seqs_per_microbatch=2,
                                          full_length=12)
    assert batch.lengths.tolist() == [3, 3, 12, 12, 12, 12, 12, 12]
    assert batch.microbatch_tokens().tolist() == [[6, 24], [24, 24]]
    assert (batch.world_size, batch.accum_steps, batch.num_groups) == (2, 2, 4)
    with pytest.raises(ValueError):
        analysis.imbalanced_minibatch(imbalance=0.5)


def test_token_layout_by_hand():
    # N = 78 tokens; local: w = 1 / (W * A * N[r, m]) = 1/24 in the 6-token microbatch, 1/96 elsewhere.
    batch = analysis.imbalanced_minibatch(2, 2, 4, full_length=12)
    local = analysis.token_layout(batch, "local")
    assert fractions(local.weight) == [Fraction(1, 24)] * 2 + [Fraction(1, 96)] * 6
    assert local.rank.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert local.microbatch.tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert local.left.tolist() == [0, 3, 6, 18, 30, 42, 54, 66]
    assert analysis.weight_ratio(local) == pytest.approx(4.0)
    token = analysis.token_layout(batch, "token")
    assert fractions(token.weight) == [Fraction(1, 78)] * 8
    assert analysis.weight_ratio(token) == pytest.approx(1.0)
    assert token.total.sum() == pytest.approx(1.0)


def test_rank_shares_by_hand_and_the_control():
    batch = analysis.imbalanced_minibatch(2, 2, 4, full_length=12)
    local = analysis.batch_rank_shares(batch, "local")
    token = analysis.batch_rank_shares(batch, "token")
    assert_allclose(local.tokens, [30 / 78, 48 / 78])
    assert_allclose(local.update, [0.5, 0.5])  # every rank gets 1/W under local
    assert_allclose(token.update, token.tokens)  # the fix: the update follows the tokens
    assert not np.allclose(local.update, local.tokens)  # control: ragged counts must show
    balanced = analysis.imbalanced_minibatch(2, 2, 1, full_length=12)
    assert_allclose(analysis.batch_rank_shares(balanced, "local").update, [0.5, 0.5])
    assert_allclose(analysis.batch_rank_shares(balanced, "local").update,
                    analysis.batch_rank_shares(balanced, "token").update)


def test_worked_example_numbers():
    batch = analysis.worked_example_minibatch()
    assert batch.microbatch_tokens().tolist() == [[3, 14], [12, 12]]
    local = analysis.token_layout(batch, "local")
    assert fractions(local.weight) == [Fraction(1, 12)] * 2 + [Fraction(1, 56)] * 2 + [Fraction(1, 48)] * 4
    assert_allclose(analysis.batch_rank_shares(batch, "local").update, [0.5, 0.5])
    assert_allclose(analysis.batch_rank_shares(batch, "token").update, [17 / 41, 24 / 41])


def test_rank_shares_of_a_constant_are_token_shares_even_though_weights_sum_below_one():
    batch = analysis.worked_example_minibatch()
    shares = analysis.rank_shares(batch.mask, batch.group_ids, batch.num_groups, 48.0, batch.plan)
    assert_allclose(shares.update, [17 / 41, 24 / 41])


def test_rank_shares_with_an_empty_rank():
    lengths = torch.tensor([0, 0, 5, 7])
    plan = make_plan("contiguous", lengths, 2, 1)
    shares = analysis.rank_shares(analysis.response_mask(lengths), torch.tensor([0, 0, 1, 1]), 2, "token", plan)
    assert_allclose(shares.tokens, [0, 1])
    assert_allclose(shares.update, [0, 1])


def test_share_sweep():
    sweep = analysis.share_sweep([1, 2, 4], world_size=2, accum_steps=2, full_length=12)
    assert_allclose(sweep.update_share["local"], [0.5, 0.5, 0.5])
    # rank 0 holds 2 * 12 / imbalance + 24 of 2 * 12 / imbalance + 72 tokens
    assert_allclose(sweep.token_share, [48 / 96, 36 / 84, 30 / 78])
    assert_allclose(sweep.update_share["token"], sweep.token_share)


# ------------------------------------------------------------------ 2. real gradients


def test_ragged_lengths():
    assert analysis.ragged_lengths(1, 8) == (12,) * 8
    lengths = np.array(analysis.ragged_lengths(12, 32))
    assert lengths.min() >= 1 and lengths.max() <= 12 and lengths.max() / lengths.min() >= 6
    # one draw serves every imbalance: a response never gets shorter than another it was longer than
    a, b = np.array(analysis.ragged_lengths(4, 32)), lengths
    assert np.all(np.subtract.outer(a, a) * np.subtract.outer(b, b) >= 0)
    assert analysis.ragged_lengths(4, 32, seed=1) != analysis.ragged_lengths(4, 32, seed=0)


def test_gradient_sweep_local_drifts_and_the_fixed_modes_do_not():
    sweep = analysis.gradient_sweep([1, 4, 12], shard="length", world_size=2, accum_steps=2)
    assert sweep.microbatch_tokens.shape == (3, 2, 2)
    assert np.all(sweep.microbatch_tokens[0] == 8 * 12)  # imbalance 1: 8 responses of 12 tokens each
    for mode in analysis.INVARIANT_MODES:
        assert sweep.relative_error[mode].max() < 1e-12, mode
        assert_allclose(sweep.cosine[mode], 1.0, atol=1e-12)
    local = sweep.relative_error["local"]
    assert local[0] < 1e-12  # balanced microbatches: the mean of means is the mean (control)
    assert local[1] > 0.1 and local[2] > local[1]  # and it grows with the imbalance
    assert sweep.cosine["local"][2] < 0.95


def test_gradient_of_a_constant_is_the_token_gradient_rescaled():
    lengths = analysis.ragged_lengths(4, 16)
    token = analysis.policy_gradient(lengths, "token")
    constant = analysis.policy_gradient(lengths, "constant")  # C = S * 12
    torch.testing.assert_close(constant, token * sum(lengths) / (16 * 12))


def test_compare():
    g = torch.tensor([1.0, 0.0])
    assert analysis.compare(g, g) == (0.0, 1.0)
    rel, cos = analysis.compare(torch.tensor([0.0, 1.0]), g)
    assert rel == pytest.approx(2 ** 0.5) and cos == pytest.approx(0.0)
    assert analysis.compare(torch.zeros(2), torch.zeros(2)) == (0.0, 1.0)


def test_ddp_check_rejects_lengths_run_ddp_cannot_build():
    with pytest.raises(ValueError):
        analysis.ddp_check([13, 1, 1, 1])


def test_ddp_check_on_real_processes():
    checks = analysis.ddp_check(analysis.ragged_lengths(12, 16), modes=("local", "token"), world_size=2,
                                accum_steps=2)
    assert [c.mode for c in checks] == ["local", "token"]
    assert all(c.max_abs_diff < 1e-12 for c in checks)
    assert checks[1].relative_error < 1e-12 and checks[0].relative_error > 0.1


# ------------------------------------------------------------------ 3. length bias


def test_resolve_and_dr_grpo_constant():
    assert analysis.resolve("constant", 16, 64) == 1024.0
    assert analysis.resolve("token", 16, 64) == "token"
    with pytest.raises(ValueError):
        analysis.resolve("mean", 16, 64)


def test_length_weights_by_hand():
    # One prompt group of 4 responses with 4, 8, 12, 16 tokens (N = 40), another with 8 tokens each (N = 32).
    view = analysis.length_weights([4, 8, 12, 16, 8, 8, 8, 8], group_size=4, max_new_tokens=20)
    assert fractions(view.token_weight["token"]) == [Fraction(1, 72)] * 8
    assert fractions(view.token_weight["sequence"])[:4] == [Fraction(1, 32), Fraction(1, 64), Fraction(1, 96),
                                                           Fraction(1, 128)]
    assert fractions(view.token_weight["group"]) == [Fraction(1, 80)] * 4 + [Fraction(1, 64)] * 4
    assert fractions(view.token_weight["constant"]) == [Fraction(1, 160)] * 8
    assert_allclose(view.share("sequence"), 1 / 8)
    assert_allclose(view.group_share("group"), [0.5, 0.5])
    assert_allclose(view.group_share("token"), [40 / 72, 32 / 72])
    assert_allclose(view.share("constant"), view.share("token"))


def test_staircase_lengths():
    assert analysis.staircase_lengths(2, 3, 4) == [4, 8, 12, 8, 16, 24]


def test_correct_vs_wrong_by_hand():
    # 4 correct of 10 tokens and 4 wrong of 40; rewards 1/0 give advantages +a and -a.
    view = analysis.correct_vs_wrong(10, 40, num_correct=4, group_size=8, max_new_tokens=64)
    a = view.advantage_correct
    assert view.advantage_wrong == pytest.approx(-a)
    # token: w = 1/N, so the push in units of 1/N is the advantage itself
    assert view.push_per_token["token"] == pytest.approx((a, -a))
    # sequence: w = 1/(S |o_i|), times N = 200: 200/80 for a correct token, 200/320 for a wrong one
    up, down = view.push_per_token["sequence"]
    assert up == pytest.approx(a * 200 / 80) and down == pytest.approx(-a * 200 / 320)
    assert abs(down) / up == pytest.approx(0.25)  # the length bias: 10 / 40
    assert view.push_per_token["constant"] == pytest.approx((a * 200 / 512, -a * 200 / 512))
    assert view.update_share["token"] == pytest.approx((0.2, 0.8))  # 40 of 200 tokens are correct
    assert view.update_share["sequence"] == pytest.approx((0.5, 0.5))
    # control: with equal lengths the length bias disappears
    even = analysis.correct_vs_wrong(20, 20, num_correct=4)
    up, down = even.push_per_token["sequence"]
    assert abs(down) / up == pytest.approx(1.0)
    with pytest.raises(ValueError):
        analysis.correct_vs_wrong(10, 40, num_correct=0)


def test_correct_vs_wrong_without_std_scaling():
    view = analysis.correct_vs_wrong(10, 10, num_correct=2, group_size=8, scale_by_std=False)
    assert view.advantage_correct == pytest.approx(0.75) and view.advantage_wrong == pytest.approx(-0.25)


def test_batch_dependence():
    view = analysis.batch_dependence([4, 16, 64], own_length=16, num_sequences=16, group_size=4, max_new_tokens=64)
    assert_allclose(view.token_weight["token"], [1 / (16 + 15 * 4), 1 / 256, 1 / (16 + 15 * 64)])
    assert_allclose(view.token_weight["sequence"], 1 / (16 * 16))
    assert_allclose(view.token_weight["constant"], 1 / (16 * 64))
    assert_allclose(view.token_weight["group"], [1 / (4 * (16 + 3 * 4)), 1 / (4 * 64), 1 / (4 * (16 + 3 * 64))])


# ------------------------------------------------------------------ 4. SFT and DPO


def test_sft_has_the_same_bug_and_the_same_fix():
    sweep = analysis.gradient_sweep([1, 4], modes=("local", "token"), shard="length", loss="sft")
    assert sweep.relative_error["token"].max() < 1e-12
    assert sweep.relative_error["local"][0] < 1e-12 and sweep.relative_error["local"][1] > 0.1


def test_packed_pairs_by_hand():
    lengths, plan = analysis.packed_pairs(4, world_size=2, accum_steps=2, pairs_per_microbatch=8, short_length=6)
    pairs = analysis.pairs_as_minibatch(plan)
    assert pairs.microbatch_tokens().tolist() == [[2, 8], [8, 8]]
    assert lengths[:4] == (24, 24, 24, 24) and set(lengths[4:]) == {6} and len(lengths) == 2 * 26
    tokens = [[sum(lengths[2 * p] + lengths[2 * p + 1] for p in mb.tolist()) for mb in rank] for rank in plan]
    assert tokens == [[96, 96], [96, 96]]  # one token budget for every microbatch
    assert fractions(analysis.token_layout(pairs, "local").weight[[0, -1]]) == [Fraction(1, 8), Fraction(1, 32)]
    assert fractions(analysis.token_layout(pairs, "token").weight[[0, -1]]) == [Fraction(1, 26)] * 2


def test_dpo_pair_losses_longhand():
    from gradnorm.toy import make_policy, make_problem
    from torch.nn.functional import logsigmoid

    problem = make_problem(lengths=[3, 5, 2, 4], group_size=2, max_len=6)
    policy = make_policy(0)
    with torch.no_grad():
        logp = torch.log_softmax(policy(problem.inputs), -1).gather(-1, problem.targets.unsqueeze(-1)).squeeze(-1)
    margin = [float(((logp[i] - problem.ref_logp[i]) * problem.mask[i]).sum()) for i in range(4)]
    expected = [-float(logsigmoid(torch.tensor(0.1 * (margin[2 * p] - margin[2 * p + 1]), dtype=torch.float64)))
                for p in range(2)]
    got = analysis.dpo_pair_losses(policy, problem, torch.arange(2), beta=0.1)
    assert got.shape == (2, 1)
    assert_allclose(got.squeeze(-1).detach().numpy(), expected, rtol=1e-12)


def test_dpo_sweep_exact_with_equal_pair_counts_and_not_otherwise():
    sweep = analysis.dpo_sweep([1, 4])
    assert sweep.unit == "pairs" and sweep.microbatch_tokens[1].tolist() == [[2, 8], [8, 8]]
    assert sweep.relative_error["global"].max() < 1e-12
    assert sweep.relative_error["local"][0] < 1e-12  # the same number of pairs everywhere: exact
    assert sweep.relative_error["local"][1] > 0.1 and sweep.cosine["local"][1] < 0.95


# ------------------------------------------------------------------ 5. training runs (read back, no trainer launch)


def fake_run(tmp_path, name, denominator, shard, digests, grad_norms, tokens_per_rank):
    out = tmp_path / name
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"loss_denominator": denominator, "shard": shard}))
    rows = [{"step": k + 1, "grad_norm": g, "reward_mean": 0.5, "response_len_mean": 9.0, "rollout_digest": d,
             "tokens": sum(t), "tokens_per_rank": t}
            for k, (d, g, t) in enumerate(zip(digests, grad_norms, tokens_per_rank))]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return analysis.load_run(out)


def test_load_run_series_and_shared_rollouts(tmp_path):
    a = fake_run(tmp_path, "a", "local", "length", ["x", "y", "z"], [1.0, 2.0, 3.0], [[1, 3], [2, 2], [0, 4]])
    b = fake_run(tmp_path, "b", "token", "balanced", ["x", "y", "w"], [1.0, 1.0, 1.0], [[2, 2]] * 3)
    assert a.label == "local, length" and b.loss_denominator == "token" and b.shard == "balanced"
    assert_allclose(a.steps, [1, 2, 3])
    assert_allclose(a.series("grad_norm"), [1.0, 2.0, 3.0])
    assert_allclose(a.rank_token_share(0), [0.25, 0.5, 0.0])
    assert analysis.shared_rollout_steps(a, b) == 2
    assert analysis.shared_rollout_steps(a, a) == 3


def test_moving_average_is_trailing():
    assert_allclose(analysis.moving_average(np.array([1.0, 2.0, 3.0, 4.0, 5.0]), 2), [1.0, 1.5, 2.5, 3.5, 4.5])
    assert_allclose(analysis.moving_average(np.array([2.0, 4.0]), 10), [2.0, 3.0])


def test_train_run_points_at_the_trainer():
    assert analysis.TRAIN_SCRIPT.name == "train.py" and analysis.TRAIN_SCRIPT.parent.name == "gradnorm"
