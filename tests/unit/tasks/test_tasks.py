"""RepeatTask: fixed-length prompts, ragged correct answers, a reward that is exact at 1 and
partial below it, and a task that a tiny model can actually learn in a few seconds."""

import pytest
import torch

from gradnorm.tasks import CharTokenizer, RepeatTask
from gradnorm.models.tinygpt import GPTConfig, TinyGPT, generate, token_logprobs_and_entropy


@pytest.fixture
def task():
    return RepeatTask()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_encode_decode_round_trip_and_specials(task):
    tok = task.tokenizer
    for text in ["", "a", "hhh", "c07=", "abcdefgh0123456789="]:
        assert tok.decode(tok.encode(text)) == text
    ids = [tok.bos_id] + tok.encode("ab") + [tok.pad_id] + tok.encode("c") + [tok.eos_id] + tok.encode("d")
    assert tok.decode(ids) == "abc"  # skips BOS and PAD, stops at EOS
    assert tok.decode(torch.tensor(ids)) == "abc"
    assert len({tok.pad_id, tok.bos_id, tok.eos_id, *tok.encode("abcdefgh0123456789=")}) == tok.vocab_size
    with pytest.raises(ValueError):
        tok.encode("z")
    with pytest.raises(ValueError):
        CharTokenizer("aa")


def test_prompts_have_fixed_length_and_match_their_answers(task):
    prompts, answers = task.sample_prompts(200, gen(0))
    assert prompts.shape == (200, task.prompt_len) and prompts.dtype == torch.long
    assert (prompts[:, 0] == task.tokenizer.bos_id).all()
    for ids, answer in zip(prompts, answers):
        text = task.tokenizer.decode(ids)  # "c07="
        assert answer == text[0] * int(text[1:3]) and text[3] == "="
        assert task.n_min <= len(answer) <= task.n_max and text[0] in task.letters
    again, answers_again = task.sample_prompts(200, gen(0))
    torch.testing.assert_close(again, prompts, rtol=0, atol=0)
    assert answers_again == answers
    assert not torch.equal(task.sample_prompts(200, gen(1))[0], prompts)


def test_correct_response_lengths_span_at_least_8x(task):
    assert (task.n_max + 1) / (task.n_min + 1) >= 8  # answer letters + EOS
    _, loss_mask = task.demonstrations(500, gen(0))
    lengths = loss_mask.sum(1)
    assert lengths.min() == task.n_min + 1 and lengths.max() == task.n_max + 1


def test_demonstrations_are_correct_and_masked(task):
    tokens, loss_mask = task.demonstrations(50, gen(0))
    P, R = task.prompt_len, task.max_new_tokens
    assert tokens.shape == loss_mask.shape == (50, P + R)
    assert not loss_mask[:, :P].any()
    answers = [task.tokenizer.decode(t[1:2]) * int(task.tokenizer.decode(t[2:4])) for t in tokens]
    torch.testing.assert_close(task.reward(tokens[:, P:], answers), torch.ones(50), rtol=0, atol=0)
    for t, m, a in zip(tokens, loss_mask, answers):
        masked = t[m].tolist()
        assert masked == task.tokenizer.encode(a) + [task.tokenizer.eos_id]
        assert (t[P + len(masked):] == task.tokenizer.pad_id).all()


def test_reward_is_one_only_for_the_exact_terminated_answer(task):
    enc, EOS, PAD = task.tokenizer.encode, task.tokenizer.eos_id, task.tokenizer.pad_id
    answer = "ccccc"
    cases = {
        "exact": enc("ccccc") + [EOS, PAD, PAD],
        "too short": enc("cccc") + [EOS],
        "too long": enc("cccccc") + [EOS],
        "wrong letter": enc("ccdcc") + [EOS],
        "no EOS": enc("ccccc"),
        "empty": [EOS],
    }
    r = {name: task.reward([ids], [answer]).item() for name, ids in cases.items()}
    assert r["exact"] == task.max_reward == 1.0
    # Longhand values of the formula letters * length * stop.
    torch.testing.assert_close(torch.tensor([r["too short"], r["too long"], r["wrong letter"], r["no EOS"], r["empty"]]),
                               torch.tensor([4 / 5, 5 / 6, 4 / 5, 0.5, 0.0]))
    # Tokens after EOS do not matter; tensor and list inputs agree.
    padded = torch.tensor([enc("ccccc") + [EOS, EOS, PAD], enc("ccc") + [EOS, PAD, PAD, PAD, PAD]])
    torch.testing.assert_close(task.reward(padded, [answer, "ccc"]), torch.ones(2))


def test_reward_is_in_unit_interval_for_arbitrary_tokens(task):
    _, answers = task.sample_prompts(500, gen(0))
    responses = torch.randint(task.vocab_size, (500, task.max_new_tokens), generator=gen(1))
    r = task.reward(responses, answers)
    assert r.shape == (500,) and r.dtype == torch.float32
    assert (r >= 0).all() and (r <= 1).all() and (r < 1).all()


def test_invalid_configs_are_rejected():
    with pytest.raises(ValueError):
        RepeatTask(n_min=0)
    with pytest.raises(ValueError):
        RepeatTask(n_max=16, max_new_tokens=16)  # no room for 16 letters + EOS


def exact_match_rate(model, task, temperature: float) -> float:
    g = gen(123)
    prompts, answers = task.sample_prompts(128, g)
    out = generate(model, prompts, task.max_new_tokens, task.tokenizer.eos_id, task.tokenizer.pad_id,
                   temperature=temperature, generator=g)
    return (task.reward(out[:, task.prompt_len:], answers) == 1.0).float().mean().item()


def test_short_sft_warm_up_learns_the_task(task):
    """The task is learnable: 150 steps of next-token SFT (batch 32, ~2 s) take greedy exact match
    from 0 to most prompts. A control, the untrained model, gets essentially nothing right."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=task.vocab_size, block_size=task.block_size))
    untrained = exact_match_rate(model, task, temperature=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    g = gen(1)
    for _ in range(150):
        tokens, loss_mask = task.demonstrations(32, g)
        logp, _ = token_logprobs_and_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        mask = loss_mask[:, 1:].float()
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    trained = exact_match_rate(model, task, temperature=0.0)
    assert untrained < 0.05
    assert trained > 0.5, f"exact match after SFT {trained:.2f}"


def test_bimodal_task_asks_only_its_counts_and_scores_like_repeat():
    from gradnorm.tasks import BUILTIN_TASKS, builtin_task
    from gradnorm.trainer.config import TrainConfig, _choices
    bimodal = builtin_task("bimodal")
    assert bimodal.counts == (1, 2, 3, 4, 13, 14, 15, 16)
    prompts, answers = bimodal.sample_prompts(400, gen(0))
    lengths = sorted({len(a) for a in answers})
    assert lengths == list(bimodal.counts)  # every count drawn, no other
    assert 0.4 < sum(len(a) <= 4 for a in answers) / 400 < 0.6  # half short, half long
    for ids, answer in zip(prompts, answers):
        text = bimodal.tokenizer.decode(ids)
        assert answer == text[0] * int(text[1:3])
    tokens, _ = bimodal.demonstrations(20, gen(1))  # the warm-up sees the same counts
    P = bimodal.prompt_len
    demo_answers = [bimodal.tokenizer.decode(t[1:2]) * int(bimodal.tokenizer.decode(t[2:4])) for t in tokens]
    assert {len(a) for a in demo_answers} <= set(bimodal.counts)
    torch.testing.assert_close(bimodal.reward(tokens[:, P:], demo_answers), torch.ones(20), rtol=0, atol=0)
    assert builtin_task("repeat").counts == () and builtin_task("repeat").sample_prompts(50, gen(0))[1] == \
        RepeatTask().sample_prompts(50, gen(0))[1]  # the default task draws as it always did
    assert set(_choices()["task"]) == set(BUILTIN_TASKS)
    with pytest.raises(ValueError):
        builtin_task("nope")
    with pytest.raises(ValueError):
        RepeatTask(counts=(0, 3))
    with pytest.raises(ValueError, match="--task bimodal"):
        TrainConfig(task="bimodal", model="some/hf-model").validate()
