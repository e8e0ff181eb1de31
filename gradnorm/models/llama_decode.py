"""One decoding step of a Llama-family Hugging Face model, without transformers' per-call machinery.

Sampling calls the model once per new token. For a small model (or a small batch on a fast
accelerator) the arithmetic of such a call is tiny and the time goes to what transformers does
around it: output dataclasses, decorators, a fresh attention mask, a cache object's bookkeeping.
``LlamaDecoder`` runs the same step as a straight line of tensor operations over the model's own
parameters (``benchmarks/decode_ab.md`` times it against the model's forward on the tiny Qwen2
the benchmarks train):

    x = embed(token)                                           (B, 1, C)
    for each block:
        h = rms_norm(x);  q, k, v = h Wq + bq, h Wk + bk, h Wv + bv    (biases: Qwen2's q, k, v)
        q, k = rope(q, pos), rope(k, pos);  append k, v to this block's cache
        x = x + softmax(q k^T / sqrt(D) + padding) v Wo               (GQA: KV heads shared by H / KV queries)
        x = x + W_down(silu(W_gate rms_norm(x)) * W_up rms_norm(x))
    logits = rms_norm(x) W_lm

It does what the model's own modules do, operation for operation and in the same order (the
RMSNorm in float32, the rotary tables from the model's own rotary module, PyTorch's
scaled_dot_product_attention with the mask and grouped-query layout transformers' SDPA
integration gives a one-token query), so its logits are the model's, bit for bit on CPU
(``tests/unit/models/test_llama_decode.py``, against the model called with its cache, for tiny Llama and
Qwen2 with and without prompt padding, dropping rows as sampling does). The prompt's prefill
still goes through the model itself: its causal-and-padding mask is one call per generation, and
its cache is copied into this one.

It covers the classes in ``SUPPORTED`` as transformers builds them with SDPA attention, a rotary
embedding of a fixed table and no sliding window (``unsupported``: anything else, and FSDP2's
sharded parameters, goes through the model's own forward, as before).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
"""Causal LMs whose blocks are exactly: RMSNorm, q/k/v/o projections with rotary q and k, RMSNorm, SwiGLU."""

STATIC_ROPE = ("default", "linear", "llama3")
"""Rotary types whose inverse frequencies do not change with the sequence length (dynamic NTK,
LongRoPE and YaRN's attention scaling are left to the model)."""


def unsupported(model: nn.Module, total_len: int) -> str | None:
    """Why ``LlamaDecoder`` cannot stand in for ``model`` on sequences of ``total_len`` tokens; None if it can."""
    # FSDP2's DTensor shards (whose forward is a collective) and quantized weights are tensor subclasses.
    if any(type(p.data) is not torch.Tensor for p in model.parameters()):
        return "its parameters are tensor subclasses (FSDP2 shards, quantized weights)"
    name = type(model).__name__
    if name not in SUPPORTED:
        return f"{name} is not one of {', '.join(SUPPORTED)}"
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return f"attention implementation {getattr(config, '_attn_implementation', None)!r} is not 'sdpa'"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {config.hidden_act!r} is not 'silu'"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in STATIC_ROPE:
        return f"rotary type {rope_type!r} is not one of {', '.join(STATIC_ROPE)}"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "some layers use sliding-window attention"
    window = getattr(config, "sliding_window", None)
    if window is not None and (getattr(config, "use_sliding_window", True) and window < total_len):
        return f"the sliding window ({window}) is shorter than the sequences ({total_len})"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1 splits the projections"
    # What this decoder reads must be what the model's forward would compute with: plain layers of
    # the model's own classes, no hook changing a call (PEFT's LoRA wraps q_proj and friends).
    for module in model.modules():
        if module._forward_hooks or module._forward_pre_hooks:
            return f"a forward hook is registered on its {type(module).__name__}"
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return "a global forward hook is registered"
    inner = model.model
    linears = [model.lm_head] + [getattr(block.self_attn, name) for block in inner.layers
                                 for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [getattr(block.mlp, name) for block in inner.layers for name in ("gate_proj", "up_proj", "down_proj")]
    if any(type(layer) is not nn.Linear for layer in linears) or type(inner.embed_tokens) is not nn.Embedding:
        return "some projections are not plain nn.Linear / nn.Embedding (adapters, quantization)"
    norms = [inner.norm] + [n for block in inner.layers for n in (block.input_layernorm, block.post_attention_layernorm)]
    if any(not type(n).__name__.endswith("RMSNorm") or not hasattr(n, "variance_epsilon") for n in norms):
        return "some norms are not the model's RMSNorm"
    for p in model.parameters():
        if not p.is_floating_point():
            return "its parameters are not floating-point (quantized)"
    return None


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # The model's RMSNorm, step for step: float32 statistics, the weight applied in the input dtype.
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _layers_of(hf_cache: Any) -> list[tuple[Tensor, Tensor]]:
    """(keys, values) of every block of a transformers cache, each (B, KV, T, D)."""
    if hasattr(hf_cache, "layers"):  # transformers >= 4.56: one object per layer
        return [(layer.keys, layer.values) for layer in hf_cache.layers]
    return list(zip(hf_cache.key_cache, hf_cache.value_cache))


class LlamaDecoder:
    """The decoding steps of a ``SUPPORTED`` model after its prefill, on a preallocated KV cache.

    ``model`` is the ``...ForCausalLM``; ``hf_cache`` the cache its prefill call returned for the
    prompts; ``attention`` (B, P) the prompts' padding mask (1 = a real token); ``total_len``
    the most positions a row will reach (P + max_new_tokens); ``rows`` (B,) the prefill row of
    each sequence, when the prefill ran on distinct prompts only (``sampling.distinct_prompts``).
    The parameters are read, not copied: the decoder is valid for the generation it was made for,
    while the weights do not change.
    """

    def __init__(self, model: nn.Module, hf_cache: Any, attention: Tensor, total_len: int, rows: Tensor | None = None):
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.norm, self.eps = inner.norm.weight, inner.norm.variance_epsilon
        self.lm_head, self.lm_bias = model.lm_head.weight, model.lm_head.bias
        # Each block's tensors, looked up once (nn.Module attribute access costs microseconds a time).
        self.blocks = [(b.input_layernorm.weight, b.input_layernorm.variance_epsilon,
                        b.self_attn.q_proj.weight, b.self_attn.q_proj.bias, b.self_attn.k_proj.weight,
                        b.self_attn.k_proj.bias, b.self_attn.v_proj.weight, b.self_attn.v_proj.bias,
                        b.self_attn.o_proj.weight, b.self_attn.o_proj.bias,
                        b.post_attention_layernorm.weight, b.post_attention_layernorm.variance_epsilon,
                        b.mlp.gate_proj.weight, b.mlp.gate_proj.bias, b.mlp.up_proj.weight, b.mlp.up_proj.bias,
                        b.mlp.down_proj.weight, b.mlp.down_proj.bias) for b in inner.layers]
        first = inner.layers[0].self_attn
        self.head_dim = first.head_dim
        self.heads = first.q_proj.out_features // first.head_dim
        self.kv_heads = first.k_proj.out_features // first.head_dim
        self.groups = first.num_key_value_groups  # query heads per KV head
        self.scaling = first.scaling
        prefill = _layers_of(hf_cache)
        _, KV, P, D = prefill[0][0].shape
        B = len(attention)
        # Rotary tables for every position, from the model's own module: cos/sin of position p are
        # elementwise functions of p, so a row of the table is what a call at p would compute.
        probe = self.embed  # the rotary module reads only its device and dtype, as the model's calls do
        positions = torch.arange(total_len, device=probe.device)[None]  # (1, total_len)
        cos, sin = inner.rotary_emb(probe, positions)
        self.cos, self.sin = cos[0], sin[0]  # (total_len, D)
        shape = (len(self.blocks), B, KV, total_len, D)
        self.k = prefill[0][0].new_zeros(shape)
        self.v = prefill[0][0].new_zeros(shape)
        for layer, (k, v) in enumerate(prefill):
            self.k[layer, :, :, :P] = k if rows is None else k[rows]
            self.v[layer, :, :, :P] = v if rows is None else v[rows]
        self.length = P  # positions in the cache
        # (B, total_len): which cached positions a query may attend to; every position after the
        # prompt is a sampled token, hence real
        self.mask = torch.cat([attention.bool(), attention.new_ones(B, total_len - P, dtype=torch.bool)], dim=1)
        self.padded = bool((~self.mask).any())  # any prompt padding left in the batch

    def keep(self, rows: Tensor) -> None:
        """Keep only the sequences ``rows`` (B',), in that order (finished rows leaving the batch)."""
        self.k, self.v, self.mask = self.k[:, rows], self.v[:, rows], self.mask[rows]
        self.padded = bool((~self.mask).any())

    @torch.no_grad()
    def step(self, token: Tensor, position: Tensor) -> Tensor:
        """Feed one token per row (B,) at positions ``position`` (B,); returns the next logits (B, V)."""
        B, end = token.shape[0], self.length + 1
        # transformers drops the mask when no position is padding (and lets SDPA share the KV heads);
        # otherwise a one-token query's heads are folded onto their KV head, against a (B, 1, 1, end) mask.
        mask = None if not self.padded else self.mask[:, None, None, :end]
        cos = self.cos[position][:, None, None, :]  # (B, 1, 1, D)
        sin = self.sin[position][:, None, None, :]
        x = F.embedding(token[:, None], self.embed)  # (B, 1, C)
        H, D, KV = self.heads, self.head_dim, self.kv_heads
        for layer, (ln1, eps1, wq, bq, wk, bk, wv, bv, wo, bo, ln2, eps2, wg, bg, wu, bu, wd, bd) in enumerate(self.blocks):
            h = _rms_norm(x, ln1, eps1)
            q = F.linear(h, wq, bq).view(B, 1, H, D).transpose(1, 2)  # (B, H, 1, D)
            k = F.linear(h, wk, bk).view(B, 1, KV, D).transpose(1, 2)  # (B, KV, 1, D)
            v = F.linear(h, wv, bv).view(B, 1, KV, D).transpose(1, 2)
            # q and k rotated as one tensor: elementwise, so each value is what rotating it alone gives
            qk = torch.cat([q, k], dim=1)  # (B, H + KV, 1, D)
            qk = qk * cos + _rotate_half(qk) * sin
            q, k = qk[:, :H], qk[:, H:]
            self.k[layer, :, :, self.length] = k[:, :, 0]
            self.v[layer, :, :, self.length] = v[:, :, 0]
            keys, values = self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # (B, KV, end, D)
            if self.groups == 1:
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling)
            elif mask is None:
                out = F.scaled_dot_product_attention(q, keys, values, scale=self.scaling, enable_gqa=True)
            else:  # (B, KV, H / KV, D): the query heads of a KV head side by side, as one query each
                out = F.scaled_dot_product_attention(q.reshape(B, KV, self.groups, D), keys, values,
                                                     attn_mask=mask, scale=self.scaling)
            out = out.reshape(B, H, 1, D).transpose(1, 2).reshape(B, 1, H * D)  # (B, 1, H * D)
            x = x + F.linear(out, wo, bo)
            h = _rms_norm(x, ln2, eps2)
            x = x + F.linear(F.silu(F.linear(h, wg, bg)) * F.linear(h, wu, bu), wd, bd)
        self.length = end
        return F.linear(_rms_norm(x, self.norm, self.eps), self.lm_head, self.lm_bias)[:, -1]  # (B, V)
