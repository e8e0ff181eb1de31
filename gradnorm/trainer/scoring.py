"""Score responses in chunks of similar length, so the forward pass skips most of the padding.

A rollout batch is cut to its longest response R, but responses are ragged: on the built-in task
they hold 2 to 17 tokens, so about a third of the positions a full-width forward computes are
padding after EOS. Sorting the rows by response length and scoring them in a few chunks, each
cut to its own longest response, skips most of that work; the per-row results are the same
(a causal model's logits at position t never see positions after t), placed back in the caller's
row order and zero after each chunk's width, where the response mask is zero anyway.

The number of chunks k is picked by a cost model in token positions: a chunk of n rows cut to
width w costs (n + ``overhead_rows``) * w, the extra rows standing for the fixed cost of one more
forward call. Rows are split into k chunks of equal count by sorted length, k = 1 .. max_chunks.

Several forward passes before one backward are fine under DDP (each parameter's gradient hook
still fires once per backward, so the all-reduce happens once) and under FSDP2 (each forward
gathers the parameters it needs). ``score`` is any ``(model, tokens, prompt_len) -> (logp,
entropy)`` of the policies (``tinygpt.response_logprobs``, ``hfmodels.response_logprobs``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

Score = Callable[[nn.Module, Tensor, int], tuple[Tensor, Tensor]]


def length_chunks(lengths: Tensor, prompt_len: int, max_chunks: int = 4, overhead_rows: int = 16) -> list[Tensor]:
    """Row indices (into ``lengths`` (n,)) in chunks of similar length, cheapest k by the cost model."""
    order = torch.argsort(lengths.cpu(), stable=True)  # (n,) shortest first
    widths = lengths.cpu()[order] + prompt_len  # (n,) non-decreasing

    def cost(chunks):
        return sum((len(c) + overhead_rows) * int(widths[c[-1]]) for c in chunks if len(c))

    candidates = [torch.arange(len(order)).chunk(k) for k in range(1, max(1, min(max_chunks, len(order))) + 1)]
    best = min(candidates, key=cost)
    return [order[c].to(lengths.device) for c in best if len(c)]


def score_by_length(score: Score, model: nn.Module, tokens: Tensor, prompt_len: int, lengths: Tensor,
                    max_chunks: int = 4) -> tuple[Tensor, Tensor]:
    """``score(model, tokens, prompt_len)`` computed chunk by chunk; (logp, entropy), each (n, R).

    tokens (n, P + R); lengths (n,) the response lengths |o_i| from the response mask (the
    positions a chunk drops are outside the mask). Differentiable: gradients flow to every chunk.
    """
    n, R = tokens.shape[0], tokens.shape[1] - prompt_len
    chunks = length_chunks(lengths, prompt_len, max_chunks)
    if len(chunks) <= 1:
        return score(model, tokens, prompt_len)
    logp = entropy = None
    for rows in chunks:
        width = max(int(lengths[rows].max()), 1)  # this chunk's longest response
        mb_logp, mb_entropy = score(model, tokens[rows, : prompt_len + width], prompt_len)  # (n_c, width) each
        if logp is None:
            logp, entropy = mb_logp.new_zeros(n, R), mb_entropy.new_zeros(n, R)
        # out-of-place index_put keeps autograd happy; columns past `width` stay 0 (masked out)
        logp = logp.index_put((rows,), torch.nn.functional.pad(mb_logp, (0, R - width)))
        entropy = entropy.index_put((rows,), torch.nn.functional.pad(mb_entropy, (0, R - width)))
    return logp, entropy
