"""A tiny causal transformer, a KV cache for sampling, and the log-probs GRPO needs.

The policy of the built-in task is small enough to train on two CPU cores in minutes:

    idx (B, T) -> token + position embeddings -> n_layer pre-LayerNorm blocks -> LayerNorm
               -> lm_head -> logits (B, T, V)

Two forward paths share every weight:

- ``model(idx)`` is the full causal pass that training uses (one call per microbatch).
- ``model(idx, kv_cache=cache)`` is the incremental pass that sampling uses: the keys and values
  of earlier positions are read from the cache instead of being recomputed, so each new token
  costs O(T) attention instead of a full O(T^2) forward.

``generate`` samples a batch of responses. Each row must be a pure function of (weights, its
prompt, its own uniforms): the trainer has each rank sample only its share of the global batch,
with per-sequence noise, and gathers the rest, which is only correct if a sequence's tokens do
not depend on the batch it was sampled in.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from gradnorm.core.grpo import entropy_from_logprobs
from gradnorm.models.sampling import decode, distinct_prompts


@dataclass
class GPTConfig:
    vocab_size: int
    """Number of token ids, special tokens included."""
    block_size: int
    """Maximum total sequence length (prompt + response); the size of the position table."""
    n_layer: int = 2
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 64
    """Width of the residual stream C."""


class KVCache:
    """Keys and values of every layer for the positions already processed.

    Storage is allocated once for ``max_len`` positions, shape (n_layer, B, H, max_len, D), so a
    decoding step writes in place instead of concatenating. ``pos`` is the number of positions
    already written; the next forward call writes at [pos, pos + T) and then advances it.
    """

    def __init__(self, config: GPTConfig, batch_size: int, device, dtype):
        head_dim = config.n_embd // config.n_head
        shape = (config.n_layer, batch_size, config.n_head, config.block_size, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v (B, H, T, D) at [pos, pos + T) and return all keys/values so far (B, H, pos + T, D)."""
        end = self.pos + k.size(2)
        self.k[layer, :, :, self.pos:end] = k
        self.v[layer, :, :, self.pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, num_tokens: int) -> None:
        """Called once per forward pass, after every layer has written its keys and values."""
        self.pos += num_tokens

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only the sequences ``rows`` (B',), in that order: the decode batch without its finished rows.
        A row may be named several times (a group's shared prompt, prefilled once, copied to each completion).

        One copy of the storage, (n_layer, B', H, max_len, D), each time rows leave the batch.
        """
        self.k = self.k[:, rows]
        self.v = self.v[:, rows]


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_head must divide n_embd"
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None, layer: int,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        # (B, T, C) -> (B, H, T, D)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))

        if attn_mask is not None:  # packed rows: causal within each sequence, nothing across
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        elif kv_cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            start = kv_cache.pos
            k, v = kv_cache.update(layer, k, v)  # (B, H, start + T, D)
            if T == 1:
                # The single new query may see every cached key: no mask at all.
                y = F.scaled_dot_product_attention(q, k, v)
            else:
                # SDPA's is_causal aligns the mask top-left, which is only right when start == 0.
                # Query i sits at absolute position start + i and may see keys 0 .. start + i.
                mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(diagonal=start)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None, layer: int,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, layer, attn_mask)
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """A GPT-2 shaped decoder, small enough for CPU RL.

    The lm head is untied from the token embedding: with a vocabulary of ~20 ids, tying would save
    about a thousand parameters and nothing else, while coupling the input and output geometry of
    a model that starts from scratch. Untied is the simpler thing to reason about here.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2: each residual branch adds to the stream, 2 per block; shrink their output
        # projections so the stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # Every draw comes from torch's global RNG in a fixed order: torch.manual_seed(s) before
        # construction gives the same weights every time.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def new_kv_cache(self, batch_size: int) -> KVCache:
        """An empty cache for ``batch_size`` sequences of up to ``block_size`` tokens."""
        p = self.lm_head.weight
        return KVCache(self.config, batch_size, device=p.device, dtype=p.dtype)

    def forward(self, idx: torch.Tensor, kv_cache: KVCache | None = None, logits_to_keep: int = 0,
                position_ids: torch.Tensor | None = None, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) for token ids idx (B, T); only the last ``logits_to_keep`` positions if > 0.

        Without a cache, this is the full causal pass over positions 0 .. T-1. With a cache, idx
        holds the T tokens at positions kv_cache.pos .. kv_cache.pos + T - 1; their keys and
        values are appended to the cache, and the logits are those the full pass would give at
        these positions (to float rounding). ``logits_to_keep`` (as in Hugging Face models) runs
        the final LayerNorm and the head on the positions the caller scores, not on the prompt's.

        Packed rows: ``position_ids`` (B, T) restart at 0 at every sequence of a row, and
        ``segment_ids`` (B, T) number the sequences; a query then sees only the keys of its own
        sequence at or before it, so each sequence's logits are those it gets alone.
        """
        B, T = idx.shape
        start = 0 if kv_cache is None else kv_cache.pos
        if position_ids is None:
            if start + T > self.config.block_size:
                raise ValueError(f"sequence of {start + T} tokens exceeds block_size {self.config.block_size}")
            pos = torch.arange(start, start + T, device=idx.device)  # (T,)
        else:
            if int(position_ids.max()) >= self.config.block_size:
                raise ValueError(f"a packed sequence exceeds block_size {self.config.block_size}")
            pos = position_ids  # (B, T)
        attn_mask = None
        if segment_ids is not None:
            same = segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)  # (B, T, T) query, key
            attn_mask = (same & torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()).unsqueeze(1)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for layer, block in enumerate(self.blocks):
            x = block(x, kv_cache, layer, attn_mask)
        if kv_cache is not None:
            kv_cache.advance(T)
        if logits_to_keep > 0:
            x = x[:, -logits_to_keep:]  # (B, logits_to_keep, C)
        return self.lm_head(self.ln_f(x))  # (B, T or logits_to_keep, V)


@torch.no_grad()
def generate(
    model: TinyGPT,
    prompts: torch.Tensor,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    uniforms: torch.Tensor | None = None,
    reduce=None,
    drop_finished: bool = True,
) -> torch.Tensor:
    """Sample up to ``max_new_tokens`` tokens after each prompt; returns (B, P + max_new_tokens).

    prompts: (B, P), all of the same length P (no left padding). The output always has the full,
    fixed width P + max_new_tokens: once a row has produced EOS, every later position of that row
    is ``pad_id``, and if every row finishes early the loop stops and the rest stays ``pad_id``.
    A row that never samples EOS is truncated at max_new_tokens (its response has no EOS).

    ``temperature`` 0 is greedy decoding (for evaluation). The noise is ``uniforms``
    (B, max_new_tokens), one row per sequence (the trainer's per-sequence draws), or else a block
    drawn up front from ``generator``; ``reduce`` keeps ranks that decode together in step, and
    finished rows leave the decode batch unless ``drop_finished=False`` (``sampling.decode`` says
    how). ``use_cache=False`` recomputes the full forward at every step
    (O(T^2) per token); it exists for the KV-cache benchmark and for tests that compare the two paths.

    Determinism: row i's tokens are a function of (weights, prompt i, uniforms[i]) alone, so with
    the same inputs the output is bit-identical on every call (on the same hardware and thread
    settings), and a row samples the same tokens in any batch (to the rounding of its logits).
    """
    B, P = prompts.shape
    total = P + max_new_tokens
    if total > model.config.block_size:
        raise ValueError(f"P + max_new_tokens = {total} exceeds block_size {model.config.block_size}")
    cache = None
    rows = torch.arange(B, device=prompts.device)  # (B_t,): the rows of out in the decode batch

    def advance(token: torch.Tensor, t: int, out: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        nonlocal rows
        if keep is not None:  # rows have finished: the batch shrinks to keep
            rows = rows[keep]
            if use_cache:
                cache.keep(keep)
        if use_cache:
            return model(token[:, None], kv_cache=cache)[:, -1]  # only the new position
        return model(out[rows, : P + t + 1])[:, -1]  # the whole prefix again

    if use_cache:  # a group's shared prompt is prefilled once, then its cache and logits are copied
        first, copies = distinct_prompts(prompts)
        cache = model.new_kv_cache(len(first))
        prefill = model(first, kv_cache=cache)[:, -1]  # (B_distinct, V)
        if copies is not None:
            cache.keep(copies)
            prefill = prefill[copies]  # (B, V)
    else:
        prefill = model(prompts)[:, -1]  # (B, V)
    return decode(prompts, prefill, advance, max_new_tokens, eos_id, pad_id, temperature, generator, uniforms, reduce,
                  drop_finished)


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log pi(target) and entropy of pi, both (B, T), from logits (B, T, V).

        log pi(y_t) = log_softmax(z_t)[y_t]
        H_t         = -sum_v pi_v log pi_v

    Computed in float32: the importance ratio exp(logp_new - logp_old) amplifies rounding, and
    low-precision log_softmax is a known source of spurious off-policy drift.
    """
    logp_all = F.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T)
    entropy = entropy_from_logprobs(logp_all)  # (B, T), reusing the one log_softmax
    return logp, entropy


def response_logprobs(model: TinyGPT, tokens: torch.Tensor, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of the response tokens, each (B, L - prompt_len).

    tokens: (B, L) prompt + response. Position j of the result scores tokens[:, prompt_len + j]
    given tokens[:, : prompt_len + j]. The logits at position s predict token s + 1, so the
    response's predictions are logits[:, prompt_len - 1 :] of the pass over tokens[:, :-1].
    Positions after EOS are scored too (as PAD); the caller's response mask removes them.
    """
    R = tokens.shape[1] - prompt_len
    logits = model(tokens[:, :-1], logits_to_keep=R)  # (B, R, V): positions prompt_len - 1 .. L - 2
    return token_logprobs_and_entropy(logits, tokens[:, prompt_len:])
