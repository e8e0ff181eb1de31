"""Packed rows and token-budget microbatches: the pieces, each against a longhand reference.

- ``pack`` + ``score_packed``: the log-probs of a packed microbatch equal the padded ones inside
  the response mask, for TinyGPT (fp64, exactly as computed one sequence at a time) and for tiny
  random Llama and Qwen2 models (transformers builds the block-diagonal mask from the restarted
  positions). Controls: positions that do not restart, or attention that crosses a boundary,
  change them.
- ``budget_plan``: every sequence once, every microbatch within the budget, ranks with different
  counts; a sequence over the budget and ``balanced`` are refused.
- idle passes: a rank topped up with zero-weight passes has exactly the gradient it has without
  them (control: the same pass with its mask on moves it).
- ``step.skew``: the logged skew fields against a longhand computation over the plan.

The trainer's whole step under --pack and --microbatch-tokens, on 1 and 2 ranks under DDP and
FSDP2, is tests/distributed/test_trainer_step.py.
"""

import math
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from gradnorm.core.accumulate import accumulate_gradients
from gradnorm.core.grpo import TokenLosses
from gradnorm.core.sharding import budget_plan, passes, validate_plan
from gradnorm.models.tinygpt import GPTConfig, TinyGPT
from gradnorm.trainer import record, step
from gradnorm.trainer.chunks import score_by_length
from gradnorm.trainer.config import TrainConfig
from gradnorm.trainer.packing import pack, score_packed
from gradnorm.trainer.policy import TinyGPTPolicy
from gradnorm.trainer.rollout import Rollout

P, R = 5, 9
LENGTHS = torch.tensor([9, 1, 4, 7, 2, 9, 3, 5])


def batch(vocab=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, vocab, (len(LENGTHS), P + R), generator=g)
    return tokens, torch.arange(R) < LENGTHS[:, None]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    # block_size covers a whole packed row, so the control can number a row's positions without restarts
    return TinyGPT(GPTConfig(vocab_size=20, block_size=8 * (P + R), n_layer=2, n_head=4, n_embd=32)).double()


def test_pack_restarts_positions_and_fills_rows_first_fit():
    tokens, _ = batch()
    rows = pack(tokens, P, LENGTHS, rows_of=2)
    spans = (LENGTHS + P).tolist()
    for i, span in enumerate(spans):
        where = rows.segment_ids == i
        assert int(where.sum()) == span
        assert rows.position_ids[where].tolist() == list(range(span))  # restart at every sequence
        assert rows.tokens[where].tolist() == tokens[i, :span].tolist()
    assert rows.tokens.shape[1] == 2 * (P + R) and int((rows.segment_ids >= 0).sum()) == sum(spans)
    assert len(rows.targets) == int(LENGTHS.sum())  # one prediction per response token


def test_packed_log_probs_equal_the_padded_ones(tiny):
    tokens, mask = batch()
    policy = TinyGPTPolicy(tiny)
    packed = score_packed(policy, tiny, tokens, P, LENGTHS)
    padded = score_by_length(policy.score, tiny, tokens, P, LENGTHS)
    for a, b in zip(packed, padded):
        assert_close(torch.where(mask, a, 0.0), torch.where(mask, b, 0.0), rtol=1e-12, atol=1e-12)


def test_control_positions_that_do_not_restart_or_attention_across_sequences_differ(tiny):
    tokens, mask = batch()
    rows = pack(tokens, P, LENGTHS)
    alone = score_by_length(TinyGPTPolicy(tiny).score, tiny, tokens, P, LENGTHS)[0][mask]
    running = torch.arange(rows.tokens.shape[1]).expand_as(rows.tokens)
    for kwargs in (dict(position_ids=running, segment_ids=rows.segment_ids),  # positions keep counting
                   dict(position_ids=rows.position_ids)):  # no segments: attention crosses sequences
        logits = tiny(rows.tokens, **kwargs)
        logp = torch.log_softmax(logits[rows.keep], -1).gather(-1, rows.targets[:, None])[:, 0]
        moved = logp.new_zeros(len(LENGTHS), R).index_put(rows.out, logp)[mask]
        assert (moved - alone).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hugging_face_packed_rows_equal_padded_ones(kind, tmp_path):
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
    from tiny_models import BUILDERS

    from gradnorm.models import hf
    from gradnorm.trainer.policy import HFPolicy

    model_dir = BUILDERS[kind](tmp_path / kind, seed=0)
    tokenizer = hf.load_tokenizer(str(model_dir))
    model = hf.load_causal_lm(str(model_dir), tokenizer.pad_token_id).double()
    policy = HFPolicy(model, tokenizer)
    tokens, mask = batch(vocab=60)
    tokens[tokens == tokenizer.pad_token_id] = 5
    tokens[1, :3] = tokens[4, :1] = tokenizer.pad_token_id  # left-padded prompts: packing drops the padding
    packed = score_packed(policy, model, tokens, P, LENGTHS)[0]
    padded = score_by_length(policy.score, model, tokens, P, LENGTHS)[0]
    assert_close(packed[mask], padded[mask], rtol=1e-10, atol=1e-10)
    # control: the same rows with positions that never restart look like one long sequence to
    # transformers, whose attention then crosses from each sequence into the ones before it
    rows = pack(tokens, P, LENGTHS, tokenizer.pad_token_id)
    running = torch.arange(rows.tokens.shape[1]).expand_as(rows.tokens)
    logits = model(input_ids=rows.tokens, position_ids=running, use_cache=False).logits
    logp = torch.log_softmax(logits[rows.keep], -1).gather(-1, rows.targets[:, None])[:, 0]
    crossed = logp.new_zeros(len(LENGTHS), R).index_put(rows.out, logp)[mask]
    assert (crossed - padded[mask]).abs().max() > 1e-3


# ------------------------------------------------------------------ token budgets


def test_a_budget_plan_keeps_every_sequence_once_within_the_budget():
    lengths = torch.tensor([20, 3, 7, 12, 1, 20, 9, 4, 15, 6, 2])  # 11: divides by no W x A but 1 x 11
    for kind in ("interleave", "contiguous", "length"):
        for world_size in (1, 2, 3):
            plan = budget_plan(kind, lengths, world_size, budget=40, prompt_len=5)
            validate_plan(plan, len(lengths))
            assert all(int((lengths[mb] + 5).sum()) <= 40 for rank in plan for mb in rank)
            assert passes(plan) == max(len(rank) for rank in plan)
    counts = [len(rank) for rank in budget_plan("length", lengths, 2, 40, 5)]
    assert counts[0] < counts[1]  # the short half needs fewer microbatches than the long half


def test_a_budget_refuses_a_sequence_over_it_and_the_balanced_sharding():
    with pytest.raises(ValueError, match="a sequence of 25 tokens does not fit a microbatch budget of 24"):
        budget_plan("interleave", torch.tensor([20, 3]), 1, budget=24, prompt_len=5)
    with pytest.raises(ValueError, match="cannot follow --shard 'balanced'"):
        budget_plan("balanced", torch.tensor([20, 3]), 1, budget=100)


def test_idle_passes_add_exactly_nothing():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(len(LENGTHS), R, dtype=torch.float64))
    mask = torch.arange(R) < LENGTHS[:, None]
    group_ids = torch.arange(len(LENGTHS)) // 4

    def losses(idx):
        loss = weight[idx] ** 2
        return TokenLosses(loss=loss, pg_loss=loss, clipped=torch.zeros_like(loss, dtype=torch.bool))

    def gradient(microbatches, num_passes, idle_mask=None):
        weight.grad = None
        m = mask if idle_mask is None else idle_mask
        accumulate_gradients(torch.nn.Module(), microbatches, m, group_ids, None, "local", losses, 1, num_passes)
        return weight.grad.clone()

    microbatches = [torch.tensor([0, 1, 2]), torch.tensor([3, 4])]
    alone = gradient(microbatches, None)
    assert torch.equal(gradient(microbatches, 5), alone)  # 3 idle passes first, then the real two
    # control: what an idle pass would add if its mask were on (row 0 weighs under local)
    with_row0 = gradient([torch.tensor([0])] + microbatches, None)
    assert not torch.equal(with_row0, alone)


def test_the_trainers_passes_put_the_idle_ones_first_on_one_row_of_the_rank():
    # the passes train.step_gradient runs: every rank passes(plan) times, idle ones first, each on
    # the first row of the rank's first microbatch (a rank without rows: row 0), then its own in order
    plan = [[torch.tensor([4, 1, 2])], [torch.tensor([0, 3]), torch.tensor([5]), torch.tensor([6, 7])], []]
    assert [[rows.tolist() for rows, _ in step.rank_passes(plan, rank)] for rank in (0, 2)] == [
        [[4], [4], [4, 1, 2]], [[0], [0], [0]]]  # written out for two of the ranks
    for rank, mine in enumerate(plan):
        got = step.rank_passes(plan, rank)
        assert len(got) == passes(plan) == 3
        idle = [rows.tolist() for rows, is_idle in got if is_idle]
        filler = mine[0][:1].tolist() if mine else [0]
        assert idle == [filler] * (3 - len(mine))
        assert [rows.tolist() for rows, is_idle in got if not is_idle] == [mb.tolist() for mb in mine]
        assert [is_idle for _, is_idle in got] == sorted((is_idle for _, is_idle in got), reverse=True)


def test_the_logged_skew_against_a_longhand_computation():
    lengths = torch.tensor([2, 9, 3, 8, 1, 9, 4, 6])
    mask = torch.arange(9) < lengths[:, None]
    rollout = Rollout(tokens=torch.zeros(8, P + 9, dtype=torch.long), mask=mask, rewards=torch.zeros(8),
                      advantages=torch.zeros(8), group_ids=torch.arange(8) // 4, group_size=4, prompt_len=P)
    batch_ = step.Minibatch(rollout, None, None, "")
    cfg = TrainConfig(shard="length", grad_accum_steps=2)
    plan = step.plan_for(batch_, cfg, 2)
    got = record.skew(batch_, plan, cfg)
    # longhand: local weighs a token 1/(W A_r N[r, m]), token 1/N; a rank's local share is 1/W
    N, W = int(lengths.sum()), 2
    ratios, shares = [], []
    for rank in plan:
        for mb in rank:
            n_rm = int(lengths[mb].sum())
            ratios.append((1 / (W * len(rank) * n_rm)) / (1 / N))
        shares.append(abs(1 / W - sum(int(lengths[mb].sum()) for mb in rank) / N))
    assert math.isclose(got["skew_max"], max(ratios)) and math.isclose(got["skew_min"], min(ratios))
    assert math.isclose(got["rank_share_gap"], max(shares))
    per_mb = [int(lengths[mb].sum()) for rank in plan for mb in rank]
    assert (got["mb_tokens_min"], got["mb_tokens_max"]) == (min(per_mb), max(per_mb))
    assert got["skew_max"] > 2 and got["skew_min"] < 1  # ranks sorted by length: short microbatches shout
    assert 0 < got["padding_fraction"] < 1
    assert record.skew(batch_, plan, TrainConfig(shard="length", grad_accum_steps=2, pack=True))["padding_fraction"] \
        < got["padding_fraction"]  # packing computes fewer positions


# ------------------------------------------------------------------ bad input that needs the model


def test_a_hugging_face_run_checks_its_budget_and_its_packing_with_exit_code_2(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
    from tiny_models import build_tiny_llama

    from gradnorm.train import main
    from gradnorm.trainer import policy

    model_dir = build_tiny_llama(tmp_path / "tiny-llama", seed=0)
    capsys.readouterr()  # the builder's progress bars
    prompts = str(Path(__file__).resolve().parents[3] / "examples" / "arithmetic.jsonl")
    flags = ["--model", str(model_dir), "--prompts", prompts, "--prompts-per-step", "2", "--group-size", "2",
             "--max-new-tokens", "8", "--steps", "1", "--no-plot", "--export-hf", "none"]
    assert main([*flags, "--microbatch-tokens", "10", "--output-dir", str(tmp_path / "a")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "Loading weights" not in line]  # transformers' bar
    assert len(err) == 1 and "--microbatch-tokens 10 is smaller than the longest sequence" in err[0], err
    # --pack on a model that packs correctly trains; the control, one whose packed attention crosses
    # from sequence to sequence (positions that never restart), is refused in one line
    assert main([*flags, "--pack", "--output-dir", str(tmp_path / "b")]) == 0
    capsys.readouterr()

    def crossing(self, module, rows):
        running = torch.arange(rows.tokens.shape[1], device=rows.tokens.device).expand_as(rows.tokens)
        return module(input_ids=rows.tokens, position_ids=running, use_cache=False).logits

    monkeypatch.setattr(policy.HFPolicy, "packed_logits", crossing)
    assert main([*flags, "--pack", "--output-dir", str(tmp_path / "c")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "Loading weights" not in line]
    assert len(err) == 1 and "cannot take packed rows" in err[0], err
