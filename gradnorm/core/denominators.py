"""Denominators as per-token weights: the pure core of gradnorm (no torch.distributed here).

Every normalization mode is a weight ``w[i, t]`` on token t of sequence i in the minibatch objective

    J = sum_{i,t} w[i, t] * l[i, t] * M[i, t]

where ``M`` is the response mask actually used for the loss and ``l`` the per-token loss. With W
ranks, A microbatches per rank and the counts of the whole minibatch B (all ranks, all microbatches):

    mode        w[i, t] (the weight in J)            what it means
    local       1 / (W * A * N[r, m])                mean of per-microbatch means (the old bug)
    token       1 / N                                mean over every token of B
    sequence    1 / (S_tok * |o_i|)                  mean over sequences of per-sequence means
    group       1 / (N_groups * N_g(i))                    mean over prompt groups of per-group means
    C > 0       1 / C                                sum over B divided by a constant (Dr GRPO)

N = tokens in B, N[r, m] = tokens in microbatch m of rank r, |o_i| = tokens of sequence i,
S_tok = sequences of B with at least one token, N_g = tokens of group g, N_groups = groups with a token.

Two counts of sequences, kept apart. S is every sequence of B (prompts-per-step * group-size, the
S of every (S, T) shape): Dr GRPO's constant C = S * max_new_tokens counts it, and it is what
the GRPO papers and TRL average per-sequence means over. S_tok counts only the sequences with at
least one token in the mask used for the loss, and is what ``sequence`` divides by: a sequence
without tokens has no per-sequence mean (0/0) and adds nothing to the sum, so counting it would
shrink every other sequence's weight by S_tok/S, a factor set by how many responses the batch
happened to mask out entirely (DAPO's overlong filtering, say), not by anything to learn from.
Whenever every response has a token the two agree, and the trainer guarantees it (the EOS
counts), so there ``sequence`` is the paper's GRPO exactly. TRL's ``grpo`` loss takes the mean of
per-sequence means over the sequences of each device's microbatch (``clamp(min=1)`` makes an
empty one count as 0 in the sum and 1 in the denominator), divides by A, and lets DDP average
over W: a weight of 1 / (W * A * S_mb * |o_i|), which is 1 / (S * |o_i|) only when every
microbatch holds S / (W * A) sequences.

Only ``local`` depends on where a sequence landed (through N[r, m]); every other weight is a
function of the minibatch alone, which is why those modes are invariant to W, A and sharding.
A zero denominator gives weight zero, never NaN: a token can only meet one if the set it is
averaged over is empty, and then there is nothing to weight.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Union, get_args

import torch
from torch import Tensor

Mode = Literal["local", "token", "sequence", "group"]
Denominator = Union[Mode, float]
MODES: tuple[str, ...] = get_args(Mode)  # the one list of mode names

_ACCEPTED = (
    'one of "local", "token", "sequence", "group", or a positive finite number '
    '(a constant C such as 2048 or "1e3"; Dr GRPO uses C = sequences * max_new_tokens)'
)


def parse_denominator(value: object) -> Denominator:
    """Validate a user's denominator: a mode name, or a positive finite constant C.

    >>> parse_denominator("token"), parse_denominator("1e3"), parse_denominator(2048)
    ('token', 1000.0, 2048.0)
    """
    if isinstance(value, str):
        if value in MODES:
            return value  # type: ignore[return-value]
        try:
            constant = float(value)
        except ValueError:
            raise ValueError(f"invalid loss denominator {value!r}: expected {_ACCEPTED}") from None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        constant = float(value)
    else:
        raise ValueError(f"invalid loss denominator {value!r}: expected {_ACCEPTED}")
    if not (math.isfinite(constant) and constant > 0):
        raise ValueError(f"invalid loss denominator {value!r}: expected {_ACCEPTED}")
    return constant


# ---------------------------------------------------------------------------------------------
# Counting: one small integer vector per rank; its sum over ranks is everything any mode needs.
# ---------------------------------------------------------------------------------------------


def count_tokens(lengths: Tensor, group_ids: Tensor, num_groups: int) -> Tensor:
    """The count vector of one rank's share of the minibatch, over all its microbatches.

    ``lengths`` (n,) are the response-token counts |o_i| of the rank's sequences, taken from the
    mask actually used for the loss; ``group_ids`` (n,) are their global prompt-group indices.
    Returns int64 ``[N, S_tok, N_0, ..., N_{G-1}]``. Counts add up, so summing this vector over ranks
    (one all-reduce) yields the counts of the whole minibatch.
    """
    lengths = lengths.to(torch.int64)
    tokens = lengths.sum().reshape(1)  # N
    sequences = (lengths > 0).sum().reshape(1)  # S_tok: sequences with at least one token
    group_tokens = torch.zeros(num_groups, dtype=torch.int64, device=lengths.device)
    group_tokens.index_add_(0, group_ids.to(torch.int64), lengths)  # N_g
    return torch.cat([tokens, sequences, group_tokens])


def rank_count_vector(microbatches: Sequence[Tensor], lengths: Tensor, group_ids: Tensor, num_groups: int) -> Tensor:
    """``count_tokens`` over every microbatch of one rank: ``microbatches[m]`` indexes ``lengths`` (S,)."""
    idx = torch.cat(list(microbatches)) if microbatches else torch.zeros(0, dtype=torch.long)
    return count_tokens(lengths[idx], group_ids[idx], num_groups)


@dataclass(frozen=True)
class Counts:
    """Counts of the whole minibatch B, over all ranks and all microbatches."""

    tokens: int
    """N: response tokens in B."""
    sequences: int
    """S_tok: sequences of B with at least one response token (not every sequence of B, S)."""
    group_tokens: Tensor
    """N_g, shape (num_groups,), int64: response tokens of each prompt group in B."""

    @property
    def active_groups(self) -> int:
        """N_groups: prompt groups of B with at least one response token (derived)."""
        return int((self.group_tokens > 0).sum())

    @classmethod
    def from_vector(cls, vector: Tensor) -> Counts:
        """Read the (summed) vector that ``count_tokens`` builds."""
        vector = vector.to(torch.int64)
        return cls(tokens=int(vector[0]), sequences=int(vector[1]), group_tokens=vector[2:].clone())

    def for_microbatch(self, mb_group_ids: Tensor) -> dict[str, int | Tensor]:
        """The global counts one microbatch's loss takes, by the names ``gradnorm.audit`` offers them:
        ``num_tokens`` N, ``num_sequences`` S_tok, ``num_groups`` N_groups, and ``group_tokens`` (n,)
        N_g(i) of each of its sequences (``mb_group_ids`` (n,)). ``loss_weights`` takes them back."""
        return {"num_tokens": self.tokens, "num_sequences": self.sequences, "num_groups": self.active_groups,
                "group_tokens": self.group_tokens.to(mb_group_ids.device)[mb_group_ids]}


# ---------------------------------------------------------------------------------------------
# One tiny function per mode: mb_mask (n, T) -> w (n, T), the token's weight in J.
# ---------------------------------------------------------------------------------------------


def _weight(mb_mask: Tensor, denominator: Tensor | int, dtype: torch.dtype) -> Tensor:
    """mask / denominator with one correctly rounded division, and 0 where the denominator is 0.

    Denominators are formed as exact int64 products first, so each weight is 1/den rounded once.
    """
    den = torch.as_tensor(denominator, dtype=torch.int64, device=mb_mask.device)
    inv = torch.where(den > 0, 1.0 / den.clamp(min=1).to(dtype), torch.zeros((), dtype=dtype))
    return mb_mask.to(dtype) * inv


def _local(mb_mask, mb_groups, counts, world_size, accum_steps, dtype):
    # ALGO LOGIC (the bug): each microbatch divides by its own token count N[r, m], then by A,
    # then DDP divides by W. A token in a small microbatch weighs more than one in a full one.
    return _weight(mb_mask, world_size * accum_steps * int(mb_mask.sum()), dtype)


def _token(mb_mask, mb_groups, counts, world_size, accum_steps, dtype):
    # ALGO LOGIC (the fix): every token of B weighs 1/N, wherever it landed.
    return _weight(mb_mask, counts.tokens, dtype)


def _sequence(mb_mask, mb_groups, counts, world_size, accum_steps, dtype):
    seq_tokens = mb_mask.sum(-1, keepdim=True).to(torch.int64)  # (n, 1) |o_i|
    return _weight(mb_mask, counts.sequences * seq_tokens, dtype)  # S_tok * |o_i| (S_tok, not S: see above)


def _group(mb_mask, mb_groups, counts, world_size, accum_steps, dtype):
    group_tokens = counts.group_tokens.to(mb_mask.device)[mb_groups].unsqueeze(-1)  # (n, 1) N_g(i)
    return _weight(mb_mask, counts.active_groups * group_tokens, dtype)


WeightFn = Callable[..., Tensor]
WEIGHT_FNS: dict[str, WeightFn] = {
    "local": _local,
    "token": _token,
    "sequence": _sequence,
    "group": _group,
}


def token_weights(
    mb_mask: Tensor,
    mb_group_ids: Tensor,
    denominator: Denominator,
    counts: Counts | None,
    *,
    world_size: int,
    accum_steps: int,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """w (n, T): each token's weight in the minibatch objective J, for one microbatch.

    ``mb_mask`` (n, T) is the microbatch's response mask, ``mb_group_ids`` (n,) its sequences'
    global group indices, ``counts`` the global counts (``None`` is allowed for ``local``, the
    only mode that needs none). W and A are used by ``local`` alone: no other mode divides by A,
    because N, S_tok, N_g and N_groups already cover every microbatch of every rank.
    """
    if isinstance(denominator, str):
        fn = WEIGHT_FNS[denominator]
        if denominator != "local" and counts is None:
            raise ValueError(f"loss denominator {denominator!r} needs the global counts")
        return fn(mb_mask, mb_group_ids, counts, world_size, accum_steps, dtype)
    # A constant C: the weight is 1/C whatever the batch holds.
    return mb_mask.to(dtype) / denominator


@dataclass(frozen=True)
class _PerSequence(Counts):
    """Counts as one microbatch's loss receives them (``Counts.for_microbatch``): ``group_tokens``
    holds N_g(i) of its n sequences, each its own "group" 0..n-1, and N_groups is given, not counted."""

    groups: int = 0

    @property
    def active_groups(self) -> int:
        return self.groups


_NEEDS = {"token": ("num_tokens",), "sequence": ("num_sequences",), "group": ("num_groups", "group_tokens")}


def loss_weights(
    mask: Tensor,
    denominator: Denominator | str,
    *,
    world_size: int,
    accum_steps: int = 1,
    num_tokens: int | None = None,
    num_sequences: int | None = None,
    num_groups: int | None = None,
    group_tokens: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """w (n, T): each token's weight in J for one microbatch, from the global counts by name.

    The drop-in form of ``token_weights`` for a loss function of your own: it takes the counts as
    ``Counts.for_microbatch`` (and ``gradnorm.audit``) names them, so a loss with the audit's
    signature can be audited as it is. The same table of mode functions computes both.
    ``mask`` (n, T) is the microbatch's response mask; ``denominator`` a mode name or a constant
    (anything ``parse_denominator`` accepts); a mode that needs a count not given raises. Multiply
    by W (``rank_weights``) before DDP's mean over ranks.
    """
    denominator = parse_denominator(denominator)
    given = {"num_tokens": num_tokens, "num_sequences": num_sequences, "num_groups": num_groups,
             "group_tokens": group_tokens}
    missing = [name for name in _NEEDS.get(denominator, ()) if given[name] is None]
    if missing:
        raise ValueError(f"loss denominator {denominator!r} needs {' and '.join(missing)}")
    n = mask.shape[0]
    per_sequence = torch.zeros(n, dtype=torch.int64) if group_tokens is None else torch.as_tensor(group_tokens)
    counts = _PerSequence(tokens=int(num_tokens or 0), sequences=int(num_sequences or 0),
                          group_tokens=per_sequence.to(device=mask.device, dtype=torch.int64), groups=int(num_groups or 0))
    return token_weights(mask, torch.arange(n, device=mask.device), denominator, counts,
                         world_size=world_size, accum_steps=accum_steps, dtype=dtype)


def needs_global_counts(denominator: Denominator) -> bool:
    """Whether a mode needs the one all-reduce of counts (only ``local`` does without)."""
    return denominator != "local" and isinstance(denominator, str)


def rank_weights(weights: Tensor, world_size: int, grad_reduction: Literal["mean", "sum"] = "mean") -> Tensor:
    """The weights a rank puts into its backward loss so that the reduced gradient is dJ/dtheta.

    Derivation. Rank r backpropagates L_r = sum over its tokens of v * l. DDP (and FSDP by
    default) then *averages* gradients over the W ranks, so the parameters receive

        (1/W) * sum_r dL_r/dtheta.

    We want sum_r sum_{tokens of r} w * dl/dtheta = dJ/dtheta, hence v = W * w. If gradients are
    summed instead of averaged, v = w. This is the one place where DDP's mean is undone.
    """
    if grad_reduction == "mean":
        return weights * world_size
    if grad_reduction == "sum":
        return weights
    raise ValueError(f"grad_reduction must be 'mean' or 'sum', got {grad_reduction!r}")


def microbatch_loss(
    mb_token_loss: Tensor,
    mb_mask: Tensor,
    mb_group_ids: Tensor,
    denominator: Denominator,
    counts: Counts | None,
    *,
    world_size: int,
    accum_steps: int,
) -> tuple[Tensor, Tensor]:
    """THE heart of a step: (L, w) for one microbatch, L = sum_t W * w * l * M (a scalar to backward).

    ``mb_token_loss`` l (n, T) and ``mb_mask`` M (n, T) are the microbatch's; w (n, T) comes back
    too, for the logged statistics. The trainer (``accumulate.accumulate_gradients``), the simulation
    (``simulate.simulated_gradient``) and the benchmarks all build their backward loss here.
    """
    w = token_weights(mb_mask, mb_group_ids, denominator, counts,
                      world_size=world_size, accum_steps=accum_steps, dtype=mb_token_loss.dtype)
    return (rank_weights(w, world_size) * torch.where(mb_mask, mb_token_loss, 0.0)).sum(), w


def mask_from_lengths(lengths: Tensor | Sequence[int], max_len: int | None = None) -> Tensor:
    """M (S, T) bool from response lengths alone: True on the first |o_i| positions of row i.

    T is ``max_len``, or the longest length (at least 1) when omitted. Not to be confused with
    ``rollout.response_mask``, which finds each response's end from its sampled EOS token; this
    mask is for responses whose lengths are given (the toy problem, the notebooks' minibatches).
    """
    lengths = torch.as_tensor(lengths)
    max_len = max(int(lengths.max()), 1) if max_len is None else max_len
    return torch.arange(max_len, device=lengths.device) < lengths.unsqueeze(-1)  # (S, T)
