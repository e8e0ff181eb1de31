"""How a set of rows goes through the model: in chunks of similar response length, and the same
number of calls on every FSDP2 rank.

Scoring in chunks. A rollout batch is cut to its longest response R, but responses are ragged: on
the built-in task they hold 2 to 17 tokens, so about a third of the positions a full-width forward
computes are padding after EOS. ``score_by_length`` sorts the rows by response length and scores
them in a few chunks, each cut to its own longest response; the per-row results are the same (a
causal model's logits at position t never see positions after t), placed back in the caller's row
order and zero after each chunk's width, where the response mask is zero anyway. The number of
chunks k is picked by a cost model in token positions: a chunk of n rows cut to width w costs
(n + ``overhead_rows``) * w, the extra rows standing for the fixed cost of one more forward call.
Several forward passes before one backward are fine under DDP (each parameter's gradient hook
still fires once per backward) and under FSDP2 (each forward gathers the parameters it needs).

Prompts once. A chunk's rows come in groups that share a prompt; ``HFPolicy.score`` computes each
distinct prompt once and the responses against copies of its KV cache (``hf.response_logprobs``,
two calls where the model allows it: ``hf.prompts_once``), the same log-probs to fp32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from gradnorm.trainer.packing import pack


def length_chunks(lengths: Tensor, prompt_len: int, max_chunks: int = 4, overhead_rows: int = 16) -> list[Tensor]:
    """Row indices (into ``lengths`` (n,)) in chunks of similar length, cheapest k by the cost model."""
    order = torch.argsort(lengths.cpu(), stable=True)  # (n,) shortest first
    widths = lengths.cpu()[order] + prompt_len  # (n,) non-decreasing

    def cost(chunks):
        return sum((len(c) + overhead_rows) * int(widths[c[-1]]) for c in chunks if len(c))

    candidates = [torch.arange(len(order)).chunk(k) for k in range(1, max(1, min(max_chunks, len(order))) + 1)]
    best = min(candidates, key=cost)
    return [order[c].to(lengths.device) for c in best if len(c)]


def forward_positions(tokens: Tensor, lengths: Tensor, prompt_len: int, pad_id: int | None = None,
                      packed: bool = False, max_chunks: int = 4) -> int:
    """The token positions the forward of one microbatch computes: each chunk of ``score_by_length``
    is n rows cut to its longest response, or, packed, the rows ``pack`` fills."""
    lengths = lengths.cpu()
    if packed:
        return pack(tokens, prompt_len, lengths, pad_id).positions
    return sum(len(rows) * (prompt_len + max(int(lengths[rows].max()), 1))
               for rows in length_chunks(lengths, prompt_len, max_chunks))


def score_by_length(score: Callable[[nn.Module, Tensor, int], tuple[Tensor, Tensor]], model: nn.Module, tokens: Tensor, prompt_len: int, lengths: Tensor,
                    max_chunks: int = 4, calls: int | None = None) -> tuple[Tensor, Tensor]:
    """``score(model, tokens, prompt_len)`` computed chunk by chunk; (logp, entropy), each (n, R).

    tokens (n, P + R); lengths (n,) the response lengths |o_i| from the response mask (the
    positions a chunk drops are outside the mask). Differentiable: gradients flow to every chunk.

    ``calls`` makes exactly that many forward calls (at least the chunks'): under FSDP2 every
    forward is a collective (each block's parameters are all-gathered), so ranks whose rows chunk
    differently must still call the model equally often, or the gathers pair up wrongly and the
    ranks hang. The extra calls score one row's first response token and add it times zero: no
    value changes, and the backward still visits every block (``lockstep_calls``).
    """
    n, R = tokens.shape[0], tokens.shape[1] - prompt_len
    chunks = length_chunks(lengths, prompt_len, max_chunks)
    extra = 0 if calls is None else calls - len(chunks)
    if extra < 0:
        raise ValueError(f"calls={calls} is fewer than the {len(chunks)} chunks these rows need")
    if len(chunks) <= 1 and not extra:
        return score(model, tokens, prompt_len)
    logp, entropy = tokens.new_zeros(n, R, dtype=torch.float32), tokens.new_zeros(n, R, dtype=torch.float32)
    for rows in chunks:
        width = max(int(lengths[rows].max()), 1)  # this chunk's longest response
        mb_logp, mb_entropy = score(model, tokens[rows, : prompt_len + width], prompt_len)  # (n_c, width) each
        logp, entropy = logp.to(mb_logp.dtype), entropy.to(mb_entropy.dtype)
        # out-of-place index_put keeps autograd happy; columns past `width` stay 0 (masked out)
        logp = logp.index_put((rows,), torch.nn.functional.pad(mb_logp, (0, R - width)))
        entropy = entropy.index_put((rows,), torch.nn.functional.pad(mb_entropy, (0, R - width)))
    for _ in range(extra):  # lockstep: zero weight, the same blocks visited
        idle_logp, _ = score(model, tokens[:1, : prompt_len + 1], prompt_len)
        logp = logp + 0.0 * idle_logp.sum()
    return logp, entropy


def lockstep_calls(row_sets: list[Tensor], lengths: Tensor, prompt_len: int, packed: bool = False,
                   max_chunks: int = 4) -> int:
    """The forward calls that scoring each rank's ``row_sets[r]`` (its rows of ``lengths``) takes,
    at most: what every rank must make under FSDP2 (``score_by_length(..., calls=)``). Every rank
    computes the same number from the rows of all ranks, which it already knows (no collective).
    A packed microbatch is one call; a rank with no rows still makes one (on a throwaway row)."""
    if packed:
        return 1
    lengths = lengths.cpu()
    return max((max(len(length_chunks(lengths[rows.cpu()], prompt_len, max_chunks)), 1) for rows in row_sets),
               default=1)
