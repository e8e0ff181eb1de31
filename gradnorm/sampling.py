"""The one sampling loop: seeded, fixed-width autoregressive decoding for any policy.

``decode`` owns everything the policies share (the output buffer, EOS bookkeeping, the draw of
each token, when to stop); a policy supplies only its prefill logits and a function that feeds one
new token and returns the next logits. TinyGPT (``tinygpt.generate``) and Hugging Face models
(``hfmodels.generate``) both call it, so their sampling semantics cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def sample_next(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """One token per row from logits (B, V); temperature 0 means greedy (argmax)."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)  # (B,)
    # float32 softmax: in bf16 the tail probabilities, and hence the samples, would be coarser.
    probs = F.softmax(logits.float() / temperature, dim=-1)  # (B, V)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)  # (B,)


@torch.no_grad()
def decode(
    prompts: Tensor,
    prefill_logits: Tensor,
    advance: Callable[[Tensor, int, Tensor], Tensor],
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Sample up to ``max_new_tokens`` after ``prompts`` (B, P); returns (B, P + max_new_tokens).

    ``prefill_logits`` (B, V) are the policy's logits after the whole prompt; ``advance(token, t,
    out)`` feeds the token (B,) just written at column P + t of ``out`` and returns the logits
    (B, V) for column P + t + 1. The output always has the full, fixed width: once a row has
    produced EOS, every later position of that row is ``pad_id``, and if every row finishes early
    the loop stops and the rest stays ``pad_id``. A row that never samples EOS is truncated at
    max_new_tokens (its response has no EOS).

    Determinism: every step draws exactly one sample for *every* row, finished or not, so the
    generator's state after step t does not depend on which rows have finished. With the same
    weights, prompts and generator state the output is bit-identical on every call (on the same
    hardware and thread settings).
    """
    B, P = prompts.shape
    out = torch.full((B, P + max_new_tokens), pad_id, dtype=torch.long, device=prompts.device)
    out[:, :P] = prompts
    finished = torch.zeros(B, dtype=torch.bool, device=prompts.device)
    logits = prefill_logits
    for t in range(max_new_tokens):
        token = sample_next(logits, temperature, generator)  # (B,)
        token = torch.where(finished, torch.full_like(token, pad_id), token)
        out[:, P + t] = token
        finished |= token == eos_id
        if t == max_new_tokens - 1 or bool(finished.all()):
            break
        logits = advance(token, t, out)
    return out
