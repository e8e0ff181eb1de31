"""Hugging Face causal LMs as gradnorm policies: load, sample with a KV cache, score responses.

``transformers`` is an optional extra (``pip install -e '.[hf]'``) and is imported only when a
function here needs it. A policy is any ``AutoModelForCausalLM``; the two functions the trainer
calls have the same signatures as their TinyGPT twins in ``gradnorm.models.tinygpt``:

    generate(model, prompts, max_new_tokens, eos_id, pad_id, temperature, generator)
        -> tokens (B, P + max_new_tokens)
    response_logprobs(model, tokens, prompt_len) -> (log pi(o_t), H_t), each (B, R)

Prompts arrive LEFT-padded to a common width P (``gradnorm.tasks.prompts``). The padding is the leading
run of PAD ids of each row; it gets attention mask 0, and positions count from the first real
token, so a row's logits do not depend on how much padding it got:

    attention_mask[i, s] = 1 once row i has had a non-PAD token at or before s
    position_ids[i, s]   = max(0, cumsum(attention_mask[i])[s] - 1)

Sampling is our own loop over the model's KV cache (``gradnorm.models.sampling.decode``, shared with
``tinygpt.generate``), not ``model.generate``: HF's sampler draws from the global RNG, while the
trainer needs sequence i of step k to be a function of (seed, k, i) and the weights, whichever
rank samples it and whatever the world size.

``examples/tiny_models.py`` writes a tiny random Llama or Qwen2 with a character-level tokenizer
(built locally, no download) to a directory that ``--model`` loads: what the offline tests train.
"""

from __future__ import annotations

import inspect
import pickle
import re
from typing import Any

import torch
from torch import Tensor, nn

from gradnorm.core.errors import first_line
from gradnorm.models.llama_decode import LlamaDecoder, unsupported
from gradnorm.models.sampling import decode, distinct_prompts
from gradnorm.models.tinygpt import token_logprobs_and_entropy

_MISSING = "Hugging Face models need transformers: pip install -e '.[hf]'"


def require_transformers():
    """The transformers module, or a one-line ImportError saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise ImportError(_MISSING) from None
    return transformers


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def load_tokenizer(name_or_path: str) -> Any:
    """The model's tokenizer, with a PAD token: EOS is used as PAD when it has none (Llama)."""
    transformers = require_transformers()
    try:
        tok = transformers.AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {name_or_path!r}: cannot load its tokenizer ({first_line(e)})") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def context_length(name_or_path: str) -> tuple[str, int] | None:
    """(field, positions): the longest sequence the model's config says it takes, read without weights.

    ``max_position_embeddings`` of the (text) config, named as the config file spells it (a config
    class may map it: GPT-2's ``n_positions``). None when the config states no context (ALiBi,
    state-space models) or cannot be read here (the weights' load then says why).
    """
    transformers = require_transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError, KeyError):
        return None
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    positions = getattr(config, "max_position_embeddings", None)
    if not isinstance(positions, int) or isinstance(positions, bool) or positions <= 0:
        return None
    return getattr(config, "attribute_map", {}).get("max_position_embeddings", "max_position_embeddings"), positions


def load_causal_lm(
    name_or_path: str,
    pad_id: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    gradient_checkpointing: bool = False,
) -> nn.Module:
    """An ``AutoModelForCausalLM`` from a Hub name or a local directory, ready to train.

    Parameters load in ``dtype`` (float32 by default: the optimizer keeps fp32 master weights and
    bf16 comes from autocast). ``pad_id`` is stored in ``config.pad_token_id``, where
    ``response_logprobs`` finds it. Gradient checkpointing is the non-reentrant kind, which
    works with DDP's no_sync and with FSDP2.
    """
    transformers = require_transformers()
    # transformers 4.56 renamed torch_dtype to dtype; 5 loads the checkpoint's own dtype without it.
    dtype_kw = "dtype" if _version(transformers.__version__) >= (4, 56) else "torch_dtype"
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(name_or_path, **{dtype_kw: dtype})
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {name_or_path!r}: cannot load it ({first_line(e)})") from None
    except pickle.UnpicklingError as e:  # a pickled weights file that holds more than tensors: never run it
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        what = f"it references {found.group(1)}" if found else "it holds more than tensors"
        raise ValueError(f"--model {name_or_path!r}: its weights are refused by the safe unpickler ({what}), "
                         "so they may be malicious; use a model directory you trust") from None
    model.config.pad_token_id = pad_id
    model.config.use_cache = False  # training passes never need a cache; sampling asks for one
    if gradient_checkpointing:  # renamed activation checkpointing in transformers 5 (the old name warns)
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(device=device, dtype=dtype)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())


def _accepts(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def _cache_kwarg(model: nn.Module) -> str:
    # transformers 5 renamed forward's `past_key_values` (and the output's) to `cache`; the old
    # name warns, then goes.
    return "cache" if _accepts(type(model).forward, "cache") else "past_key_values"


def _cache_of(output: Any, name: str) -> Any:
    return getattr(output, name, None)


# ---------------------------------------------------------------------------------------------
# The two policy functions
# ---------------------------------------------------------------------------------------------


def padding_positions(tokens: Tensor, prompt_len: int, pad_id: int) -> tuple[Tensor, Tensor]:
    """attention_mask (B, L) long and position_ids (B, L) for left-padded prompt + response.

    Only the leading run of PAD in the prompt is padding; PAD after EOS in the response keeps
    mask 1 (causality already hides it from everything the loss reads).
    """
    prompt = tokens[:, :prompt_len]
    real = torch.cumsum((prompt != pad_id).long(), dim=1) > 0  # (B, P): at or after the first real token
    attention = torch.ones_like(tokens)
    attention[:, :prompt_len] = real.long()
    positions = (torch.cumsum(attention, dim=1) - 1).clamp(min=0)  # (B, L)
    return attention, positions


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Tensor,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    uniforms: Tensor | None = None,
    reduce=None,
    drop_finished: bool = True,
    fast: bool = True,
) -> Tensor:
    """Sample up to ``max_new_tokens`` after each left-padded prompt; returns (B, P + max_new_tokens).

    Same contract as ``gradnorm.models.tinygpt.generate``: after a row's first EOS the row holds PAD, the
    loop stops once every row has finished, and row i's tokens depend on its prompt and its row of
    ``uniforms`` alone. ``model`` is the plain module, or an FSDP2 module, whose forward is a
    collective: ranks that sample different sequences then pass ``reduce`` so that all of them run
    the same number of steps. Finished rows leave the decode batch (the cache keeps the others with
    its ``batch_select_indices``, the attention mask and positions follow) unless
    ``drop_finished=False`` or the cache cannot select rows. ``use_cache=False`` recomputes the
    full prefix at every step, for tests of the cache.

    The prompts' prefill is the model's own call, on each distinct prompt once (a group's G
    completions share one; ``sampling.distinct_prompts``). The decoding steps after it are too, unless the
    model is a Llama-family one that ``gradnorm.models.llama_decode`` can step directly (``fast``,
    the default): the same operations on the same parameters, bit for bit, without transformers'
    per-call overhead, which dominates the step of a small model.
    """
    B, P = prompts.shape
    attention, positions = padding_positions(prompts, P, pad_id)  # (B, P) each
    cache_kw = _cache_kwarg(model)
    direct_steps = use_cache and fast and unsupported(model, P + max_new_tokens) is None
    # The prefill: a group's shared prompt once (``distinct_prompts``), its cache and logits then
    # copied to each completion, where the cache can copy rows; else every row (one call either
    # way, decided before it: under FSDP2 every rank must make the same calls).
    shared = use_cache and (direct_steps or hasattr(require_transformers().Cache, "batch_select_indices"))
    first, copies = distinct_prompts(prompts) if shared else (prompts, None)
    first_attention, first_positions = padding_positions(first, P, pad_id)
    step = model(input_ids=first, attention_mask=first_attention, position_ids=first_positions, use_cache=use_cache)
    cache, logits = _cache_of(step, cache_kw), step.logits[:, -1]  # logits (B_distinct, V)
    direct = None
    if direct_steps:
        direct = LlamaDecoder(model, cache, attention, P + max_new_tokens, copies)
        cache = None  # the decoder holds a copy; the model's own cache can go
    elif copies is not None and hasattr(cache, "batch_select_indices"):
        cache.batch_select_indices(copies)
    elif copies is not None:  # not a transformers Cache (a legacy tuple): prefill every row after all
        step = model(input_ids=prompts, attention_mask=attention, position_ids=positions, use_cache=True)
        cache, logits, copies = _cache_of(step, cache_kw), step.logits[:, -1], None
    if copies is not None:
        logits = logits[copies]  # (B, V)
    # A cache that cannot drop rows (not a transformers Cache, or an old one) keeps them all.
    drop_finished = drop_finished and (direct is not None or not use_cache or hasattr(cache, "batch_select_indices"))
    rows = torch.arange(B, device=prompts.device)  # (B_t,): the rows of out in the decode batch

    def advance(token: Tensor, t: int, out: Tensor, keep: Tensor | None) -> Tensor:
        nonlocal attention, positions, cache, rows
        if direct is not None:  # the same step as the model's, without transformers' machinery
            if keep is not None:
                positions = positions[keep]
                direct.keep(keep)
            positions = positions[:, -1:] + 1
            return direct.step(token, positions[:, 0])
        if keep is not None:  # rows have finished: every per-row tensor shrinks to keep
            rows, attention, positions = rows[keep], attention[keep], positions[keep]
            if use_cache:
                cache.batch_select_indices(keep)
        attention = torch.cat([attention, attention.new_ones(len(rows), 1)], dim=1)  # (B_t, P + t + 1)
        positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
        if not use_cache:  # the whole prefix again
            return model(input_ids=out[rows, : P + t + 1], attention_mask=attention, position_ids=positions,
                         use_cache=False).logits[:, -1]
        step = model(input_ids=token[:, None], attention_mask=attention, position_ids=positions[:, -1:],
                     use_cache=True, **{cache_kw: cache})
        cache = _cache_of(step, cache_kw)
        return step.logits[:, -1]  # only the new position

    return decode(prompts, logits, advance, max_new_tokens, eos_id, pad_id, temperature, generator,
                  uniforms, reduce, drop_finished)


def accepts_logits_to_keep(model: nn.Module) -> bool:
    """Whether the model's forward can compute the LM head on the last positions only."""
    return _accepts(type(model).forward, "logits_to_keep")


def prompts_once(model: nn.Module) -> str | None:
    """Why ``response_logprobs`` cannot run each distinct prompt once for ``model``, or None when it can.

    The shared-prompt forward (``response_logprobs(..., share_prompts=True)``) hands the prompts'
    KV cache, with its autograd graph, to a second call over the responses. It needs a cache class
    that can copy rows (``batch_select_indices``) and a forward that takes it. It is not used under
    activation checkpointing (transformers drops the cache there) or with sliding-window attention
    (whose cache keeps only the window). A model whose forward returns a cache that cannot copy
    rows after all (a class of its own) gets the one-call forward after pass 1, still two calls.
    """
    transformers = require_transformers()
    inner = getattr(model, "module", model)  # DDP keeps the model it wraps in .module
    if not hasattr(getattr(transformers, "Cache", None), "batch_select_indices"):
        return f"transformers {transformers.__version__}'s cache cannot copy rows"
    # transformers 5 renamed gradient checkpointing activation checkpointing (the old name warns)
    name = "is_activation_checkpointing" if hasattr(type(inner), "is_activation_checkpointing") else "is_gradient_checkpointing"
    if getattr(inner, name, False):
        return "activation checkpointing drops the cache"
    config = inner.config
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()) or (
            getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)):
        return "sliding-window attention (its cache keeps only the window)"
    return None


def response_logprobs(model: nn.Module, tokens: Tensor, prompt_len: int, *, pad_id: int | None = None,
                      keep_logits: bool | None = None, share_prompts: bool = False) -> tuple[Tensor, Tensor]:
    """Log-probs and entropies (fp32) of the response tokens, each (B, L - prompt_len).

    ``model`` may be wrapped in DDP (the call goes through its forward, so its hooks fire) or be
    an FSDP2 module; ``pad_id`` and ``keep_logits`` default to the model's config and forward
    (``HFPolicy`` passes them, read once from the unwrapped model). Only the response's
    R = L - P predictions go through the LM head (``logits_to_keep``): with a 150k vocabulary the
    prompt's logits would be most of the memory. log_softmax runs in float32 even under bf16
    autocast: exp(logp - old_logp) amplifies rounding.

    ``share_prompts`` (only where ``prompts_once(model)`` is None) computes each distinct prompt
    once, for rows that share one as a group's G completions do, in exactly two calls:

        pass 1   the distinct prompts (U, P), through the unwrapped model: their KV cache, and the
                 logits at the last prompt position (which predict each row's first response token)
        copy     cache and logits to every row that has the prompt (``distinct_prompts``' copies)
        pass 2   the responses (B, R - 1) through ``model`` (DDP's forward, once), attending to the
                 copied cache

    The graph runs from pass 2 back through the copies into pass 1, so the backward sums each
    prompt's gradient over its rows, and DDP's gradient hooks still fire once per parameter. The
    values equal the one-call forward's to fp32 rounding (the matrix products have other shapes),
    not bit for bit; the cost of the prompt part falls by G.

    Two calls whatever the rows, so that FSDP2's ranks, whose every forward is a collective, make
    the same calls: rows that share no prompt still take both passes, and a one-token response
    (nothing for pass 2 to predict) runs pass 2 on it and adds its logits times zero, which keeps
    the pass in the graph as ``score_by_length``'s idle calls do.
    """
    inner = getattr(model, "module", model)  # DDP keeps the model it wraps in .module
    if pad_id is None or keep_logits is None:
        pad_id = inner.config.pad_token_id if pad_id is None else pad_id
        keep_logits = accepts_logits_to_keep(inner) if keep_logits is None else keep_logits
    R = tokens.shape[1] - prompt_len
    if share_prompts:
        first, copies = distinct_prompts(tokens[:, :prompt_len])
        if copies is None:  # every prompt distinct: each row is its own copy
            copies = torch.arange(len(tokens), device=tokens.device)
        return _prompts_once(model, inner, tokens, prompt_len, first, copies, pad_id, keep_logits)
    attention, positions = padding_positions(tokens, prompt_len, pad_id)  # (B, L)
    kwargs = {"logits_to_keep": R} if keep_logits else {}
    logits = model(input_ids=tokens[:, :-1], attention_mask=attention[:, :-1], position_ids=positions[:, :-1],
                   use_cache=False, **kwargs).logits  # (B, R or L - 1, V)
    return token_logprobs_and_entropy(logits[:, -R:], tokens[:, prompt_len:])


def _prompts_once(model: nn.Module, inner: nn.Module, tokens: Tensor, prompt_len: int, first: Tensor, copies: Tensor,
                  pad_id: int, keep_logits: bool) -> tuple[Tensor, Tensor]:
    """``response_logprobs(..., share_prompts=True)``'s two passes (its docstring)."""
    P, R, cache_kw = prompt_len, tokens.shape[1] - prompt_len, _cache_kwarg(inner)
    first_attention, first_positions = padding_positions(first, P, pad_id)  # (U, P) each
    prompt = inner(input_ids=first, attention_mask=first_attention, position_ids=first_positions, use_cache=True,
                   **({"logits_to_keep": 1} if keep_logits else {}))
    cache = _cache_of(prompt, cache_kw)
    if not hasattr(cache, "batch_select_indices"):  # a cache class of the model's own: the one-call forward
        logp, entropy = response_logprobs(model, tokens, P, pad_id=pad_id, keep_logits=keep_logits)
        return logp + 0.0 * prompt.logits.sum(), entropy  # still two calls, pass 1 in the graph at zero weight
    cache.batch_select_indices(copies)  # (U, ...) -> (B, ...): indexing, so gradients flow back to pass 1
    attention, positions = padding_positions(tokens, P, pad_id)  # (B, L): the cache's columns, then the responses'
    fed = max(R - 1, 1)  # the responses but their last token; a one-token response is fed as it is (and unused)
    responses = model(input_ids=tokens[:, P : P + fed], attention_mask=attention[:, : P + fed],
                      position_ids=positions[:, P : P + fed], use_cache=True,
                      **({"logits_to_keep": fed} if keep_logits else {}), **{cache_kw: cache})
    first_logits = prompt.logits[:, -1:][copies]  # (B, 1, V): they predict each row's first response token
    if R == 1:  # pass 2 predicts nothing: in the graph at zero weight
        logp, entropy = token_logprobs_and_entropy(first_logits, tokens[:, P:])
        return logp + 0.0 * responses.logits.sum(), entropy
    logits = torch.cat([first_logits, responses.logits[:, -(R - 1):]], dim=1)  # (B, R, V)
    return token_logprobs_and_entropy(logits, tokens[:, P:])
