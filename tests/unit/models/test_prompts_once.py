"""Each distinct prompt once in the scoring and training forward of a Hugging Face policy.

A group's G completions share their prompt. ``hf.response_logprobs(..., share_prompts=True)``
runs the distinct prompts once, copies their KV cache and last logits to every row, and runs the
responses against the copies (two calls instead of one). What must hold:
- the log-probs, entropies and parameter gradients equal the one-call forward's to fp32
  rounding, for tiny Llama and Qwen2, with padded prompts and rows in any order (control: copying
  the wrong group's prompt is far off);
- the prompt pass really runs on the distinct prompts only (U rows, the responses on B);
- rows that share no prompt, and one-token responses, take the same two calls (what keeps FSDP2's
  ranks in lockstep), with the one-call values;
- ``prompts_once`` turns the shared forward away where it would be wrong or would break lockstep
  (activation checkpointing, sliding-window attention), and ``HFPolicy.score`` then computes every
  row's prompt; a cache that cannot copy rows gets the one-call forward after pass 1.
"""

import contextlib

import pytest
import torch
from torch.testing import assert_close

pytest.importorskip("transformers")

from tiny_models import build_tiny_llama, build_tiny_qwen2  # noqa: E402  (examples/, on the path via conftest)
from gradnorm.models import hf  # noqa: E402
from gradnorm.models.hf import load_causal_lm, load_tokenizer, prompts_once, response_logprobs  # noqa: E402
from gradnorm.trainer.policy import HFPolicy  # noqa: E402

BUILDERS = {"llama": build_tiny_llama, "qwen2": build_tiny_qwen2}
GROUPS, G, P, R = 5, 4, 9, 7
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def model(request, tmp_path_factory):
    path = BUILDERS[request.param](tmp_path_factory.mktemp(request.param))
    return load_causal_lm(str(path), pad_id=load_tokenizer(str(path)).pad_token_id)


def grouped_batch(model, seed=0):
    """(B, P + R) tokens: GROUPS prompts (some left-padded) x G random responses, rows shuffled."""
    g = torch.Generator().manual_seed(seed)
    V, pad = model.config.vocab_size, model.config.pad_token_id
    prompts = torch.randint(3, V, (GROUPS, P), generator=g)
    prompts[prompts == pad] = 3
    prompts[0, :4] = pad
    prompts[2, :1] = pad
    responses = torch.randint(3, V, (GROUPS * G, R), generator=g)
    tokens = torch.cat([prompts.repeat_interleave(G, 0), responses], dim=1)
    return tokens[torch.randperm(len(tokens), generator=g)]


@contextlib.contextmanager
def rows_per_call(model):
    """Inside: a list the model's embedding appends each forward call's row count to."""
    seen = []
    handle = model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(out.shape[0]))
    try:
        yield seen
    finally:
        handle.remove()


def values_and_grads(model, tokens, **kwargs):
    model.zero_grad(set_to_none=True)
    logp, entropy = response_logprobs(model, tokens, P, **kwargs)
    weights = torch.linspace(-1, 1, logp.shape[1])  # any loss that reads every position
    ((logp + 0.1 * entropy) * weights).sum().backward()
    return logp.detach(), entropy.detach(), torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def test_each_prompt_once_gives_the_one_call_values_and_gradients(model):
    tokens = grouped_batch(model)
    assert prompts_once(model) is None
    one_call = values_and_grads(model, tokens, share_prompts=False)
    with rows_per_call(model) as seen:
        shared = values_and_grads(model, tokens, share_prompts=True)
    assert seen == [GROUPS, GROUPS * G]  # the prompts on their distinct rows, then the responses on all
    for got, want in zip(shared, one_call):
        assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.equal(shared[2], torch.zeros_like(shared[2]))


def test_the_wrong_groups_prompt_is_caught(model, monkeypatch):
    """Control: the same two passes, each row given the next group's prompt, must not pass."""
    tokens = grouped_batch(model)
    one_call = values_and_grads(model, tokens, share_prompts=False)
    real = hf.distinct_prompts

    def shifted(prompts):
        first, copies = real(prompts)
        return first, (copies + 1) % len(first)

    monkeypatch.setattr(hf, "distinct_prompts", shifted)
    wrong = values_and_grads(model, tokens, share_prompts=True)
    assert (wrong[0] - one_call[0]).abs().max() > 1e-2
    with pytest.raises(AssertionError):
        assert_close(wrong[2], one_call[2], rtol=1e-5, atol=1e-6)


def test_distinct_prompts_and_one_token_responses_still_take_two_calls(model):
    """Two calls whatever the rows (FSDP2's ranks must make the same calls), with the one-call values."""
    tokens = grouped_batch(model)
    alone = tokens[torch.unique(tokens[:, :P], dim=0, return_inverse=True)[1].argsort(stable=True)]
    distinct = torch.stack([alone[i] for i in range(0, len(alone), G)])  # one row per prompt
    one_token = tokens[:, : P + 1]
    for rows in (distinct, one_token):
        want = values_and_grads(model, rows, share_prompts=False)
        with rows_per_call(model) as seen:
            got = values_and_grads(model, rows, share_prompts=True)
        assert seen == [GROUPS, len(rows)]
        for g, w in zip(got, want):
            assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_prompts_once_says_why_not_and_the_policy_scores_every_prompt(model, monkeypatch):
    tokens = grouped_batch(model)
    policy = HFPolicy(model)
    with rows_per_call(model) as seen, torch.no_grad():
        policy.score(model, tokens, P)
        assert seen == [GROUPS, GROUPS * G] and "each distinct prompt once" in policy.scoring(model)

        name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") \
            else "is_gradient_checkpointing"
        monkeypatch.setattr(type(model), name, property(lambda self: True))
        assert "checkpointing" in prompts_once(model) and "every row's prompt" in policy.scoring(model)
        seen.clear()
        policy.score(model, tokens, P)
        assert seen == [GROUPS * G]
        monkeypatch.undo()
        monkeypatch.setattr(model.config, "layer_types", ["sliding_attention", "full_attention"], raising=False)
        assert "sliding-window" in prompts_once(model)
        monkeypatch.undo()
        assert prompts_once(model) is None


def test_a_cache_that_cannot_copy_rows_gets_the_one_call_forward(model, monkeypatch):
    tokens = grouped_batch(model)
    with torch.no_grad():
        want, _ = response_logprobs(model, tokens, P, share_prompts=False)
        monkeypatch.setattr(hf, "_cache_of", lambda output, name: object())  # a cache class of the model's own
        got, _ = response_logprobs(model, tokens, P, share_prompts=True)
    assert torch.equal(got, want)  # the one-call forward itself, bit for bit
