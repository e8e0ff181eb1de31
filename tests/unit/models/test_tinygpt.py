"""TinyGPT: causality, the KV cache against the full pass, and reproducible sampling.

The trainer relies on two properties checked here: the cached sampling path computes the same
function as the training forward pass, and generate() is a pure function of (weights, prompts,
generator state), so every rank can regenerate the global batch bit for bit.
"""

import pytest
import torch
import torch.nn.functional as F

from gradnorm.models.tinygpt import GPTConfig, TinyGPT, generate, response_logprobs, token_logprobs_and_entropy

V, BLOCK, P = 21, 25, 5
PAD, EOS = 0, 2


def make_model(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(GPTConfig(vocab_size=V, block_size=BLOCK))


def random_tokens(B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(seed))


def test_init_is_deterministic_given_seed():
    a, b, c = make_model(0), make_model(0), make_model(1)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=name)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_forward_shape_and_block_size_limit():
    model = make_model()
    assert model(random_tokens(3, 7)).shape == (3, 7, V)
    with pytest.raises(ValueError):
        model(random_tokens(1, BLOCK + 1))


def test_causal_later_tokens_do_not_change_earlier_logits():
    model = make_model()
    idx = random_tokens(2, 12)
    changed = idx.clone()
    changed[:, 8:] = (changed[:, 8:] + 1 - 3) % (V - 3) + 3  # a different, still valid id
    before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :8], after[:, :8])
    assert not torch.allclose(before[:, 8:], after[:, 8:])  # control: the change is visible


def test_kv_cache_logits_equal_full_forward_step_by_step():
    model = make_model()
    idx = random_tokens(4, 20)
    full = model(idx)  # (B, T, V)
    cache = model.new_kv_cache(4)
    torch.testing.assert_close(model(idx[:, :P], kv_cache=cache), full[:, :P], rtol=1e-5, atol=1e-5)
    for t in range(P, 20):
        step = model(idx[:, t : t + 1], kv_cache=cache)  # (B, 1, V)
        torch.testing.assert_close(step, full[:, t : t + 1], rtol=1e-5, atol=1e-5)
    assert cache.pos == 20


def test_kv_cache_chunk_after_prefix_uses_a_correct_causal_mask():
    # T > 1 with start > 0 is the one case where SDPA's is_causal would be wrong.
    model = make_model()
    idx = random_tokens(3, 16)
    full = model(idx)
    cache = model.new_kv_cache(3)
    model(idx[:, :6], kv_cache=cache)
    torch.testing.assert_close(model(idx[:, 6:11], kv_cache=cache), full[:, 6:11], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(idx[:, 11:], kv_cache=cache), full[:, 11:], rtol=1e-5, atol=1e-5)


def sample(model, prompts, seed, **kw):
    return generate(model, prompts, max_new_tokens=20, eos_id=EOS, pad_id=PAD,
                    generator=torch.Generator().manual_seed(seed), **kw)


def test_generate_is_reproducible_and_depends_on_the_seed():
    model, prompts = make_model(), random_tokens(16, P)
    first = sample(model, prompts, seed=7)
    assert first.shape == (16, P + 20)
    torch.testing.assert_close(sample(model, prompts, seed=7), first, rtol=0, atol=0)
    assert not torch.equal(sample(model, prompts, seed=8), first)
    torch.testing.assert_close(first[:, :P], prompts, rtol=0, atol=0)


def test_generate_with_and_without_cache_sample_the_same_tokens():
    # The logits of the two paths agree to ~1e-6, so with a shared generator the inverse-CDF
    # draws land in the same bins (a flip would need a uniform draw within ~1e-6 of a boundary).
    model, prompts = make_model(), random_tokens(32, P)
    torch.testing.assert_close(sample(model, prompts, 3, use_cache=True),
                               sample(model, prompts, 3, use_cache=False), rtol=0, atol=0)
    greedy = dict(temperature=0.0)
    torch.testing.assert_close(sample(model, prompts, 3, use_cache=True, **greedy),
                               sample(model, prompts, 3, use_cache=False, **greedy), rtol=0, atol=0)


def test_positions_after_eos_are_pad():
    model, prompts = make_model(), random_tokens(64, P)
    responses = sample(model, prompts, seed=0)[:, P:]  # (B, R)
    is_eos = responses == EOS
    assert is_eos.any(1).sum() > 10  # an untrained model of 21 ids stops in most rows within 20 tokens
    after_eos = is_eos.long().cumsum(1) - is_eos.long() > 0  # strictly after the first EOS
    assert (responses[after_eos] == PAD).all()


def test_generate_stops_early_and_pads_to_the_fixed_width():
    # Rig the model to always say EOS: ln_f outputs a constant vector, lm_head maps it to EOS.
    model = make_model()
    with torch.no_grad():
        model.ln_f.weight.zero_()
        model.ln_f.bias.zero_()
        model.ln_f.bias[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[EOS, 0] = 100.0
    prompts = random_tokens(4, P)
    out = sample(model, prompts, seed=0)
    expected = torch.full((4, P + 20), PAD)
    expected[:, :P] = prompts
    expected[:, P] = EOS
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_token_logprobs_and_entropy_against_longhand():
    logits = torch.randn(2, 3, V, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(V, (2, 3), generator=torch.Generator().manual_seed(1))
    logp, entropy = token_logprobs_and_entropy(logits, targets)
    probs = logits.exp() / logits.exp().sum(-1, keepdim=True)
    for b in range(2):
        for t in range(3):
            torch.testing.assert_close(logp[b, t], probs[b, t, targets[b, t]].log())
            torch.testing.assert_close(entropy[b, t], -(probs[b, t] * probs[b, t].log()).sum())
    # Uniform logits: entropy log V. bf16 input still gives float32 output.
    logp, entropy = token_logprobs_and_entropy(torch.zeros(1, 2, V, dtype=torch.bfloat16), targets[:1, :2])
    assert logp.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(entropy, torch.full((1, 2), torch.log(torch.tensor(float(V)))))


def test_response_logprobs_scores_each_response_token_given_its_prefix():
    model, tokens = make_model(), random_tokens(3, P + 6)
    logp, entropy = response_logprobs(model, tokens, prompt_len=P)
    assert logp.shape == entropy.shape == (3, 6)
    for j in range(6):
        last = model(tokens[:, : P + j])[:, -1]  # (B, V): the prediction of token P + j
        expected = F.log_softmax(last, -1).gather(1, tokens[:, P + j, None]).squeeze(1)
        torch.testing.assert_close(logp[:, j], expected, rtol=1e-5, atol=1e-5)
