"""Hugging Face policies, offline: tiny random Llama and Qwen2 built locally, no download.

What must hold for the trainer to treat an HF model like TinyGPT:
- the tiny model and tokenizer round-trip through ``--model <dir>`` (save_pretrained / from_pretrained);
- sampling with the KV cache gives the tokens of sampling without it, and a seeded generator
  gives bit-identical rollouts (what makes rollouts independent of the world size);
- dropping finished rows from the decode batch (the cache, attention mask and positions
  cut to the running rows) samples exactly the tokens of the loop that keeps every row, on a batch
  whose rows stop at ragged steps, while the forward passes really run on fewer rows;
- left padding changes nothing: a padded row's log-probs equal those of the row alone;
- log-probs and entropies are fp32 and the gradient through padded rows is finite;
- without transformers, a one-line error says how to install it.
"""

import sys

import pytest
import torch
from torch.testing import assert_close

pytest.importorskip("transformers")

from tiny_models import build_tiny_llama, build_tiny_qwen2  # noqa: E402  (examples/, on the path via conftest)
from gradnorm.models.hf import (  # noqa: E402
    generate,
    load_causal_lm,
    load_tokenizer,
    padding_positions,
    require_transformers,
    response_logprobs,
)
from gradnorm.tasks.prompts import PromptTask  # noqa: E402
from tests.helpers import EXAMPLES  # noqa: E402

BUILDERS = {"llama": build_tiny_llama, "qwen2": build_tiny_qwen2}
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def policy(request, tmp_path_factory):
    """(model, task): a tiny random model loaded from its directory, and the example prompts."""
    path = BUILDERS[request.param](tmp_path_factory.mktemp(request.param))
    tok = load_tokenizer(str(path))
    model = load_causal_lm(str(path), pad_id=tok.pad_token_id)
    return model, PromptTask.from_file(EXAMPLES, tok, max_new_tokens=12)


def test_the_saved_model_loads_offline_with_its_chat_template(policy, tmp_path):
    model, task = policy
    assert model.config.num_hidden_layers == 2 and model.dtype == torch.float32
    assert task.tokenizer_hf.chat_template and task.prompt_ids.shape[1] == task.prompt_len
    again = build_tiny_llama(tmp_path, seed=0)
    reloaded = load_causal_lm(str(again), pad_id=0)
    assert torch.equal(reloaded.lm_head.weight, load_causal_lm(str(again), pad_id=0).lm_head.weight)


def sample(model, task, generator_seed, use_cache=True, temperature=1.0, n=6):
    prompts, _ = task.sample_prompts(n, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(generator_seed)
    ids = task.tokenizer
    return generate(model, prompts, task.max_new_tokens, ids.eos_id, ids.pad_id, temperature, g, use_cache=use_cache)


def test_kv_cache_sampling_equals_full_recomputation(policy):
    model, task = policy
    assert torch.equal(sample(model, task, 1, use_cache=True), sample(model, task, 1, use_cache=False))
    assert torch.equal(sample(model, task, 0, temperature=0.0), sample(model, task, 0, temperature=0.0, use_cache=False))


def test_seeded_sampling_is_bit_identical_and_seed_dependent(policy):
    model, task = policy
    a, b, c = sample(model, task, 7), sample(model, task, 7), sample(model, task, 8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == (6, task.prompt_len + task.max_new_tokens)
    responses, eos = a[:, task.prompt_len:], task.tokenizer.eos_id
    after_eos = (torch.cumsum((responses == eos).long(), dim=1) - (responses == eos).long()) > 0
    assert (responses[after_eos] == task.tokenizer.pad_id).all()  # PAD after the first EOS


def test_dropping_finished_rows_changes_no_token_while_the_batch_shrinks(policy):
    from gradnorm.trainer.rollout import sequence_uniforms
    from tests.helpers.decoding import decode_batch_sizes

    model, task = policy
    prompts, _ = task.sample_prompts(16, torch.Generator().manual_seed(0))  # left-padded by different amounts
    ids, R, P = task.tokenizer, task.max_new_tokens, task.prompt_len
    uniforms = sequence_uniforms(range(16), R, 0, "sample", 1)
    sizes = []
    # A random model rarely says EOS: a bonus on its logit (the same for every row) makes stops ragged.
    bonus = model.lm_head.register_forward_hook(lambda m, args, out: out + 2.5 * (torch.arange(out.shape[-1]) == ids.eos_id))
    count = model.register_forward_pre_hook(lambda m, args, kwargs: sizes.append(kwargs["input_ids"].shape[0]),
                                            with_kwargs=True)
    try:
        kept = generate(model, prompts, R, ids.eos_id, ids.pad_id, uniforms=uniforms, drop_finished=False, fast=False)
        assert set(sizes) == {16}
        for use_cache in (True, False):
            sizes.clear()
            dropped = generate(model, prompts, R, ids.eos_id, ids.pad_id, uniforms=uniforms, use_cache=use_cache,
                               fast=False)  # the model steps itself: its hooks count the rows (llama_decode: no hooks)
            assert torch.equal(dropped, kept), use_cache
            running = [int((kept[:, P : P + t + 1] != ids.eos_id).all(-1).sum()) for t in range(R - 1)]
            assert sizes == decode_batch_sizes(16, running)[: len(sizes)], (sizes, running)
    finally:
        bonus.remove()
        count.remove()
    stops = {int((row == ids.eos_id).nonzero()[0]) if (row == ids.eos_id).any() else R for row in kept[:, P:]}
    assert len(stops) >= 4 and R in stops, stops  # ragged: several stopping steps, and rows that never stop
    assert sizes[-1] < 16


def test_left_padding_does_not_change_a_rows_log_probs(policy):
    model, task = policy
    tokens = sample(model, task, 3)  # (6, P + R): rows padded by different amounts
    P, pad = task.prompt_len, task.tokenizer.pad_id
    logp, entropy = response_logprobs(model, tokens, P)
    assert logp.dtype == entropy.dtype == torch.float32 and logp.shape == (6, task.max_new_tokens)
    for i in range(len(tokens)):
        first = int((tokens[i, :P] != pad).nonzero()[0])
        alone, _ = response_logprobs(model, tokens[i : i + 1, first:], P - first)
        assert_close(logp[i : i + 1], alone, rtol=1e-5, atol=1e-5)


def test_the_gradient_through_padded_rows_is_finite(policy):
    model, task = policy
    tokens = sample(model, task, 4)
    logp, _ = response_logprobs(model, tokens, task.prompt_len)
    model.zero_grad()
    logp.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_padding_positions_count_from_the_first_real_token():
    tokens = torch.tensor([[0, 0, 5, 6, 7, 0], [4, 5, 6, 7, 0, 0]])
    attention, positions = padding_positions(tokens, prompt_len=4, pad_id=0)
    assert attention.tolist() == [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]  # PAD after the prompt stays visible
    assert positions.tolist() == [[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]


def test_missing_transformers_gives_one_line_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"^Hugging Face models need transformers: pip install -e '\.\[hf\]'$"):
        require_transformers()


def test_gradient_checkpointing_gives_the_same_gradient(policy, tmp_path):
    model, task = policy
    path = tmp_path / "model"
    model.save_pretrained(path)
    checkpointed = load_causal_lm(str(path), pad_id=task.tokenizer.pad_id, gradient_checkpointing=True).train()
    plain = load_causal_lm(str(path), pad_id=task.tokenizer.pad_id).train()
    tokens = sample(model, task, 5)
    grads = []
    for m in (plain, checkpointed):
        response_logprobs(m, tokens, task.prompt_len)[0].sum().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in m.parameters()]))
    assert getattr(checkpointed, "is_activation_checkpointing", None) or checkpointed.is_gradient_checkpointing
    assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
