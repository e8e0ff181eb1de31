"""The one sampling loop: fixed-width autoregressive decoding driven by pre-drawn uniforms.

``decode`` owns everything the policies share (the output buffer, EOS bookkeeping, the draw of
each token, when to stop); a policy supplies only its prefill logits and a function that feeds one
new token and returns the next logits. TinyGPT (``tinygpt.generate``) and Hugging Face models
(``hf.generate``) both call it, so their sampling semantics cannot drift apart.

The randomness is an argument, not a generator's running state: ``uniforms[i, t]`` in [0, 1)
decides the token of row i at response position t by inverse-CDF sampling,

    token = min{ v : cumsum(softmax(z / temperature))[v] > u * total },   total = the last cumsum

so row i's tokens depend on its own logits and its own row of uniforms alone, never on which other
rows share its batch or in what order. The trainer draws row i's uniforms from a generator seeded
by (seed, step, i) (``rollout.sequence_uniforms``); any rank can then sample any sequence and get
the tokens every other world size gets (to the rounding of the logits).

For the same reason, rows that have finished can leave the decode batch: the batch a
row shares only shrinks, which changes no draw. The tests compare the shrinking loop with the one
that keeps every row, bit for bit, for TinyGPT and tiny Llama and Qwen2 on CPU with one thread.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


DROP_AT = 1 / 8
"""Finished rows leave the decode batch once they are this share of it (or all of it). Each drop
copies the policy's per-row state (the KV cache of every row kept), so dropping one row at a time
would copy the cache at almost every step; waiting for an eighth bounds the copies by a geometric
series (7 caches at most) while at most an eighth of a step's rows are finished ones."""


class NonFiniteLogitsError(ValueError):
    """The policy produced NaN or +inf logits while sampling: its weights have diverged."""


def distinct_prompts(prompts: Tensor) -> tuple[Tensor, Tensor | None]:
    """(first, copies): the distinct rows of ``prompts`` (B, P), and which of them each row is.

    ``first[copies] == prompts``. A group's G completions share one prompt, so a policy can run the
    prompts' prefill on ``first`` alone (a G-th of the work) and copy its per-row state (the KV
    cache, the last logits) to each row with ``copies``. A row's prefill does not depend on the
    other rows of its batch, so this changes no token (the tests check it bit for bit).
    ``copies`` is None when every row is distinct (``first`` is then ``prompts`` itself, in order).
    """
    first, copies = torch.unique(prompts, dim=0, return_inverse=True)
    if len(first) == len(prompts):
        return prompts, None
    return first, copies


def sample_next(logits: Tensor, temperature: float, u: Tensor) -> Tensor:
    """One token per row from logits (B, V) and one uniform per row u (B,); temperature 0 is greedy."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)  # (B,)
    # float32 softmax: in bf16 the tail probabilities, and hence the samples, would be coarser.
    probs = F.softmax(logits.float() / temperature, dim=-1)  # (B, V)
    cdf = torch.cumsum(probs, dim=-1)  # (B, V)
    # Scaling u by the row's total (1 up to rounding) keeps u * total < cdf[-1], so the search
    # cannot fall off the end; the clamp is the belt to those braces.
    target = (u.to(cdf) * cdf[:, -1]).unsqueeze(1)  # (B, 1)
    token = torch.searchsorted(cdf, target, right=True).squeeze(1)  # (B,): first v with cdf[v] > target
    return token.clamp(max=logits.shape[-1] - 1)


def _non_finite_rows(logits: Tensor) -> Tensor:
    # -inf is a legitimate logit (a token with probability 0); NaN, +inf or a row with no finite
    # logit at all cannot be sampled from.
    # A row's max is NaN when any logit is (max propagates NaN), +inf when any is, and -inf when all
    # are: one reduction where three would read the logits three times.
    return ~torch.isfinite(logits.amax(dim=-1))


@torch.no_grad()
def decode(
    prompts: Tensor,
    prefill_logits: Tensor,
    advance: Callable[[Tensor, int, Tensor, Tensor | None], Tensor],
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    uniforms: Tensor | None = None,
    reduce: Callable[[Tensor], Tensor] | None = None,
    drop_finished: bool = True,
) -> Tensor:
    """Sample up to ``max_new_tokens`` after ``prompts`` (B, P); returns (B, P + max_new_tokens).

    ``prefill_logits`` (B, V) are the policy's logits after the whole prompt; ``advance(token, t,
    out, keep)`` feeds the tokens (B_t,) just written at column P + t of ``out`` and returns the
    logits (B_t, V) for column P + t + 1 of the rows in the decode batch. The output always has the full, fixed width: once a row has
    produced EOS, every later position of that row is ``pad_id``, and if every row finishes early
    the loop stops and the rest stays ``pad_id``. A row that never samples EOS is truncated at
    max_new_tokens (its response has no EOS).

    Finished rows leave the decode batch (``drop_finished``, the default), so short responses stop
    paying for the longest: when rows have finished since the last call, ``keep`` (B_t,) holds the
    positions, in the previous call's batch, of the rows this call runs on, in order, and the policy
    cuts its per-row state (KV cache, attention mask, positions) to them; ``keep`` is None when the
    batch is unchanged. This changes no token: row i is still drawn from its own logits and
    ``uniforms[i]``, whichever rows share its batch. ``drop_finished=False`` keeps every row to the
    end (the older loop; for the A/B benchmark and the tests that compare the two).
    Rows leave in bunches: once the finished ones are ``DROP_AT`` of the batch.

    Noise: ``uniforms`` (B, max_new_tokens), row i for row i (what the trainer passes); without
    it, one (B, max_new_tokens) block drawn up front from ``generator`` (on the generator's
    device; the global RNG when None), which ties each row's noise to its place in the batch.

    ``reduce`` sums a small int64 tensor over ranks (an all-reduce). Given, the loop stops only
    when every rank's rows have finished, so ranks that decode together (FSDP2, whose forward is
    a collective) run the same number of steps, and a non-finite logit on any rank stops all of
    them; without it, this process stops when its own rows have. A rank whose rows have all
    finished keeps stepping on one of them (its tokens are ignored) while the others decode.

    Raises NonFiniteLogitsError when a step's logits hold NaN or +inf.
    """
    B, P = prompts.shape
    device = prompts.device
    if uniforms is None and temperature == 0.0:  # greedy needs no noise: leave every RNG untouched
        uniforms = torch.zeros(B, max_new_tokens)
    elif uniforms is None:
        noise_device = generator.device if generator is not None else device
        uniforms = torch.rand(B, max_new_tokens, generator=generator, device=noise_device)
    uniforms = uniforms.to(device)  # (B, max_new_tokens)
    out = torch.full((B, P + max_new_tokens), pad_id, dtype=torch.long, device=device)
    out[:, :P] = prompts
    rows = torch.arange(B, device=device)  # (B_t,): the rows of out in the decode batch, in batch order
    live = torch.ones(B, dtype=torch.bool, device=device)  # (B_t,): which of them have not finished
    logits = prefill_logits  # (B_t, V)
    for t in range(max_new_tokens):
        bad = _non_finite_rows(logits) & live  # (B_t,): only a running row samples from its logits
        token = sample_next(logits, temperature, uniforms[rows, t])  # (B_t,): row i reads uniforms[i] wherever it sits
        token = torch.where(live, token, torch.full_like(token, pad_id))
        out[rows, P + t] = token
        live &= token != eos_id
        # One host sync per step: [rows still running, rows with non-finite logits], here and over
        # ranks (reduce sums in place, hence the copy).
        status = torch.stack([live.sum(), bad.sum()])
        total = reduce(status.clone()) if reduce is not None else status
        mine, _, running, non_finite = torch.cat([status, total]).tolist()
        if non_finite:
            raise NonFiniteLogitsError(
                f"the policy's logits became non-finite during sampling (NaN or inf at response position {t}): "
                "its weights have diverged; lower --lr (or --max-grad-norm), or resume from an earlier checkpoint")
        if t == max_new_tokens - 1 or running == 0:
            break
        keep = None
        dropped = len(rows) - max(mine, 1)  # a rank with no row left still steps on one
        if drop_finished and dropped > 0 and dropped >= DROP_AT * len(rows):
            # Drop the finished rows. A rank with none left still steps (lock-step under
            # FSDP2, whose forward is a collective) on one finished row, whose draws stay PAD.
            keep = live.nonzero().squeeze(1) if mine else live.new_zeros(1, dtype=torch.long)  # (B_{t+1},)
            rows, live, token = rows[keep], live[keep], token[keep]
        logits = advance(token, t, out, keep)
    return out
