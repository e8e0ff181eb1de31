"""The direct decoding step of Llama-family models (``gradnorm.models.llama_decode``) IS the model's.

``hf.generate`` steps a supported model with ``LlamaDecoder`` instead of the model's forward. That is
only allowed because the two give the same logits, bit for bit; what must hold:

- at every decoding step, on tiny random Llama (GQA 4/2 heads, and 4/4), and Qwen2 (q/k/v biases), the
  decoder's logits equal those of the model called with its own cache: with left-padded prompts
  (the masked, grouped-query attention), without padding (transformers' unmasked path), and across
  rows leaving the batch, including the drop that leaves no padded row. Controls: a rotary
  position off by one, and a mask that lets the padding be attended to, must change the logits;
- sampling through the decoder gives exactly the tokens of sampling through the model's forward;
- a group's shared prompt is prefilled once and copied to its rows, on both paths, sampling the
  tokens each row gets alone (control: the wrong group's copy changes them);
- ``unsupported`` turns away what the decoder would get wrong (other classes, eager attention, a
  dynamic rotary, hooks, adapter-wrapped projections, tensor-subclass parameters such as FSDP2's
  shards), and sampling then goes through the model.
"""

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from tiny_models import build_tiny_llama, build_tiny_qwen2  # noqa: E402  (examples/, on the path via conftest)
from gradnorm.models import hf  # noqa: E402
from gradnorm.models.hf import generate, load_causal_lm, load_tokenizer, padding_positions  # noqa: E402
from gradnorm.models.llama_decode import LlamaDecoder, unsupported  # noqa: E402
from gradnorm.tasks.prompts import PromptTask  # noqa: E402
from gradnorm.trainer.rollout import sequence_uniforms  # noqa: E402
from tests.helpers import EXAMPLES  # noqa: E402

BUILDERS = {"llama": build_tiny_llama, "qwen2": build_tiny_qwen2,
            "llama-mha": lambda out: build_tiny_llama(out, num_key_value_heads=4)}  # one KV head per query head
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
STEPS, DROP_AT_STEP = 10, 4


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def policy(request, tmp_path_factory):
    """(model, task): a tiny random model in eval mode, and the example prompts (left-padded)."""
    path = BUILDERS[request.param](tmp_path_factory.mktemp(request.param))
    tok = load_tokenizer(str(path))
    model = load_causal_lm(str(path), pad_id=tok.pad_token_id).eval()
    return model, PromptTask.from_file(EXAMPLES, tok, max_new_tokens=24)


def _prompts(task, padded: bool) -> torch.Tensor:
    prompts, _ = task.sample_prompts(12, torch.Generator().manual_seed(0))  # (12, P)
    pad = task.tokenizer.pad_id
    if not padded:  # the same rows with their padding replaced by a real token: no position is masked
        prompts = torch.where(prompts == pad, torch.full_like(prompts, task.tokenizer.eos_id + 1), prompts)
    return prompts


def _lockstep(model, prompts, pad_id, keep, cos_shift=0, attend_padding=False):
    """Greedy decoding, each step by the model (with its own cache) and by the decoder, from one prefill.

    Yields (step, model logits, decoder logits). ``keep`` (rows) leave together at DROP_AT_STEP.
    ``cos_shift`` / ``attend_padding`` break the decoder on purpose (the controls).
    """
    P = prompts.shape[1]
    attention, positions = padding_positions(prompts, P, pad_id)
    kw = hf._cache_kwarg(model)
    with torch.no_grad():
        out = model(input_ids=prompts, attention_mask=attention, position_ids=positions, use_cache=True)
    cache = getattr(out, kw)
    decoder = LlamaDecoder(model, cache, attention if not attend_padding else torch.ones_like(attention), P + STEPS)
    decoder.cos = decoder.cos.roll(cos_shift, dims=0)
    token = out.logits[:, -1].argmax(-1)  # (B,)
    for t in range(STEPS):
        if t == DROP_AT_STEP:
            token, attention, positions = token[keep], attention[keep], positions[keep]
            cache.batch_select_indices(keep)
            decoder.keep(keep)
        attention = torch.cat([attention, attention.new_ones(len(token), 1)], dim=1)
        positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
        with torch.no_grad():
            out = model(input_ids=token[:, None], attention_mask=attention, position_ids=positions[:, -1:],
                        use_cache=True, **{kw: cache})
        cache = getattr(out, kw)
        theirs, ours = out.logits[:, -1], decoder.step(token, positions[:, -1])
        yield t, theirs, ours
        token = theirs.argmax(-1)


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_every_step_gives_the_models_logits_bit_for_bit(policy, padded):
    model, task = policy
    assert unsupported(model, 200) is None
    prompts = _prompts(task, padded)
    pad = task.tokenizer.pad_id
    is_padded = (prompts == pad).any(-1)  # (12,)
    if padded:
        assert 0 < int(is_padded.sum()) < 12  # both kinds of row: the drop below removes every padded one
        keep = (~is_padded).nonzero().squeeze(1)
    else:
        keep = torch.tensor([0, 2, 3, 7, 11])
    steps = 0
    for t, theirs, ours in _lockstep(model, prompts, pad, keep):
        assert torch.equal(ours, theirs), (t, (ours - theirs).abs().max())
        steps += 1
    assert steps == STEPS


def test_a_wrong_position_or_mask_changes_the_logits(policy):
    """The controls: the comparison above can fail."""
    model, task = policy
    prompts, pad = _prompts(task, padded=True), task.tokenizer.pad_id
    keep = torch.arange(12)
    differs = [not torch.equal(ours, theirs) for _, theirs, ours in _lockstep(model, prompts, pad, keep, cos_shift=1)]
    assert all(differs)
    differs = [not torch.equal(ours, theirs)
               for _, theirs, ours in _lockstep(model, prompts, pad, keep, attend_padding=True)]
    assert all(differs)


def test_sampling_through_the_decoder_gives_the_models_tokens(policy, monkeypatch):
    model, task = policy
    steps = []

    class Counting(LlamaDecoder):
        def step(self, token, position):
            steps.append(len(token))
            return super().step(token, position)

    monkeypatch.setattr(hf, "LlamaDecoder", Counting)
    ids, R = task.tokenizer, task.max_new_tokens
    for padded in (True, False):
        prompts = _prompts(task, padded)
        uniforms = sequence_uniforms(range(12), R, 0, "sample", int(padded))
        direct = generate(model, prompts, R, ids.eos_id, ids.pad_id, uniforms=uniforms)
        assert steps, "the decoder did not run"
        steps.clear()
        through_model = generate(model, prompts, R, ids.eos_id, ids.pad_id, uniforms=uniforms, fast=False)
        assert not steps
        assert torch.equal(direct, through_model)


def test_unsupported_says_why_and_sampling_falls_back_to_the_model(policy, monkeypatch):
    model, task = policy
    ids, R = task.tokenizer, 6
    prompts = _prompts(task, padded=True)
    uniforms = sequence_uniforms(range(12), R, 0, "fallback")
    reference = generate(model, prompts, R, ids.eos_id, ids.pad_id, uniforms=uniforms, fast=False)
    called = []
    monkeypatch.setattr(hf, "LlamaDecoder", lambda *a: called.append(a))  # must not be reached below

    hook = model.model.layers[0].mlp.register_forward_hook(lambda m, args, out: out)
    try:
        assert "forward hook" in unsupported(model, 50)
        assert torch.equal(generate(model, prompts, R, ids.eos_id, ids.pad_id, uniforms=uniforms), reference)
    finally:
        hook.remove()

    class Adapter(nn.Linear):  # what LoRA does: a projection whose forward is not its weight's
        pass

    q = model.model.layers[1].self_attn.q_proj
    model.model.layers[1].self_attn.q_proj = Adapter(q.in_features, q.out_features, bias=q.bias is not None)
    try:
        assert "nn.Linear" in unsupported(model, 50)
    finally:
        model.model.layers[1].self_attn.q_proj = q

    monkeypatch.setattr(model.config, "_attn_implementation", "eager")
    assert "'eager'" in unsupported(model, 50)
    assert torch.equal(generate(model, prompts, R, ids.eos_id, ids.pad_id, uniforms=uniforms), reference)
    monkeypatch.undo()
    monkeypatch.setattr(hf, "LlamaDecoder", lambda *a: called.append(a))

    class Marked(torch.Tensor):  # what FSDP2's DTensor shards and quantized weights are: a tensor subclass
        pass

    original = model.model.norm.weight
    model.model.norm.weight = nn.Parameter(original.detach().as_subclass(Marked))  # as fully_shard swaps them
    try:
        assert "tensor subclasses" in unsupported(model, 50)
    finally:
        model.model.norm.weight = original

    rope = dict(model.config.rope_parameters)
    monkeypatch.setattr(model.config, "rope_parameters", {**rope, "rope_type": "dynamic"})
    assert "'dynamic'" in unsupported(model, 50)
    monkeypatch.setattr(model.config, "rope_parameters", rope)
    assert unsupported(model, 50) is None
    assert not called


def test_other_architectures_are_left_to_their_model():
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40))
    assert "GPT2LMHeadModel is not one of" in unsupported(gpt2, 10)


def test_a_groups_shared_prompt_is_prefilled_once_on_either_path(policy, monkeypatch):
    """Hugging Face sampling prefills each distinct prompt once and samples the tokens of one prefill per row."""
    model, task = policy
    ids, R, G = task.tokenizer, 12, 4
    prompts = _prompts(task, padded=True)[:5].repeat_interleave(G, dim=0)  # (20, P): 5 groups of 4
    uniforms = sequence_uniforms(range(20), R, 0, "groups")
    prefill_rows = []
    count = model.register_forward_pre_hook(lambda m, args, kw: prefill_rows.append(kw["input_ids"].shape),
                                            with_kwargs=True)
    try:  # a hook turns the direct steps off: this is the model's own path
        through_model = generate(model, prompts, R, ids.eos_id, ids.pad_id, uniforms=uniforms)
    finally:
        count.remove()
    assert prefill_rows[0] == (5, prompts.shape[1]) and all(shape[0] <= 20 for shape in prefill_rows[1:])
    alone = torch.cat([generate(model, prompts[i : i + 1], R, ids.eos_id, ids.pad_id, uniforms=uniforms[i : i + 1])
                       for i in range(20)])
    assert torch.equal(through_model, alone)
    assert torch.equal(generate(model, prompts, R, ids.eos_id, ids.pad_id, uniforms=uniforms), alone)  # direct
    assert torch.equal(generate(model, prompts, R, ids.eos_id, ids.pad_id, uniforms=uniforms, use_cache=False), alone)
    # Control: the wrong group's prefill copied to each row changes the tokens.
    first, copies = hf.distinct_prompts(prompts)
    monkeypatch.setattr(hf, "distinct_prompts", lambda p: (first, copies.roll(G)))
    assert not torch.equal(generate(model, prompts, R, ids.eos_id, ids.pad_id, uniforms=uniforms), alone)
