"""A rollout's log-probs under the sampling policy and the reference, scored once before any update.

With rollout reuse or ``--beta`` > 0 each rank trains on some rows (``shares``: the plans of the
rollout's minibatches, which every rank computes alike). Each rank scores 1/W of the batch, the
same cost on every rank (``scoring_split``: longest first, in snake order), and one all-to-all
routes every row to the rank that trains on it (``route``; ``score`` does all of it).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gradnorm.dist import comm, wrap
from gradnorm.trainer.chunks import lockstep_calls, score_by_length
from gradnorm.trainer.config import TrainConfig
from gradnorm.trainer.packing import score_packed
from gradnorm.trainer.policy import Policy
from gradnorm.trainer.rollout import Rollout
from gradnorm.trainer.step import Minibatch, plan_for


def shares(rollout: Rollout, cfg: TrainConfig, world_size: int) -> list[Tensor]:
    """The rows of a rollout batch each rank trains on over its updates: ``shares(...)[r]`` (sorted).

    Minibatch k of the rollout is its groups [k * prompts-per-step, (k + 1) * prompts-per-step),
    split by the plan ``plan_for`` makes for it at its step; rank r trains on its rows of every
    minibatch (each epoch repeats them). Only those rows need the sampling policy's and the
    reference's log-probs on rank r: about 1/W of the batch, not all of it.
    """
    S = cfg.sequences_per_step
    rows: list[list[Tensor]] = [[] for _ in range(world_size)]
    for k in range(cfg.minibatches_per_rollout):
        minibatch = rollout.groups(k * cfg.prompts_per_step, cfg.prompts_per_step)
        for r, microbatches in enumerate(plan_for(Minibatch(minibatch, None, None, ""), cfg, world_size)):
            rows[r] += [mb.cpu() + k * S for mb in microbatches]
    empty = torch.zeros(0, dtype=torch.long)
    return [torch.cat(r).sort().values if r else empty for r in rows]


def scoring_split(lengths: Tensor, world_size: int) -> list[Tensor]:
    """The rows of a rollout batch each rank scores (``score``): every row once, balanced by cost.

    lengths (S,) the response lengths. The rows are sorted longest first and dealt out in snake
    order (ranks 0, 1, ..., W-1, then W-1, ..., 0, and again), so each rank holds S / W rows (give
    or take one) with the same spread of lengths, and its length chunks cost the same. The rows a
    rank trains on (``shares``) follow the plan instead, which need not balance cost: under
    ``--shard length`` rank 0 trains on the shortest responses.
    """
    order = torch.argsort(lengths.cpu(), descending=True, stable=True)  # (S,) longest first
    lap, seat = torch.arange(len(order)).div(world_size, rounding_mode="floor"), torch.arange(len(order)) % world_size
    rank_of = torch.where(lap % 2 == 0, seat, world_size - 1 - seat)  # (S,) which rank the k-th longest goes to
    return [order[rank_of == r].sort().values for r in range(world_size)]


def score_rows(policy: Policy, module: nn.Module, rollout: Rollout, rows: Tensor, calls: int | None = None,
               packed: bool = False) -> Tensor:
    """(n, R) log-probs under ``module`` of ``rows`` (n,) of the rollout batch, in that order.

    A forward needs a row, so ``rows`` empty scores a throwaway copy of row 0 (and returns it: (1, R)).
    ``calls`` makes exactly that many forward calls (``score_by_length``; FSDP2's lockstep).
    """
    P = rollout.prompt_len
    scored = rows.to(rollout.tokens.device) if len(rows) else rows.new_zeros(1, device=rollout.tokens.device)
    tokens, lengths = rollout.tokens[scored], rollout.lengths[scored]
    if packed:
        return score_packed(policy, module, tokens, P, lengths)[0]
    return score_by_length(policy.score, module, tokens, P, lengths, calls=calls)[0]


def route(scored: Tensor, split: list[Tensor], shares: list[Tensor], rank: int) -> Tensor:
    """(S, ...): every row's scores sent to the rank that trains on it; this rank's rows filled, 0 elsewhere.

    ``scored`` (n, ...) holds the rows ``split[rank]`` this rank scored, in that order. One
    all-to-all: rank r sends rank q the rows of ``split[r]`` that ``shares[q]`` holds. Every rank
    knows every split and every share (both come from the global lengths), so no collective is
    needed to agree on the sizes, and each rank moves only its own rows, about S / W of them.
    """
    S, W = sum(len(s) for s in shares), len(shares)
    owner = torch.empty(S, dtype=torch.long)  # (S,) the rank that trains on each row
    for q, share in enumerate(shares):
        owner[share.cpu()] = q
    sent_to = owner[split[rank].cpu()]  # (n,)
    order = torch.argsort(sent_to, stable=True).to(scored.device)  # grouped by destination, rows ascending
    from_each = [split[p].cpu()[owner[split[p].cpu()] == rank] for p in range(W)]  # what each rank sends here: O(S)
    received = comm.all_to_all_rows(scored[order], torch.bincount(sent_to, minlength=W).tolist(),
                                    [len(rows) for rows in from_each])
    return scored.new_zeros(S, *scored.shape[1:]).index_put((torch.cat(from_each).to(scored.device),), received)


def score(policy: Policy, modules: list[nn.Module | None], rollout: Rollout, shares: list[Tensor] | None = None,
          rank: int = 0, packed: bool = False) -> list[Tensor | None]:
    """(S, R) log-probs under each of ``modules`` (the sampling policy, the reference; None: not
    needed, no forward) of the rows rank ``rank`` trains on, ``shares[rank]`` (``shares``), zero on
    every other row; every row when ``shares`` is None.

    With W = len(shares) ranks each one scores 1/W of the batch balanced by cost
    (``scoring_split``), not its own rows, whose cost the plan can make lopsided; then ``route``
    sends every row's log-probs, of all the modules at once, to the rank that trains on it: one
    all-to-all, which every rank calls together. Under FSDP2 every forward is a collective, so each
    rank makes as many forward calls as the rank whose rows need the most (``lockstep_calls``,
    from every rank's rows, which each rank knows); a rank with no rows makes them on a throwaway
    copy of row 0.
    """
    needed = [m for m in modules if m is not None]
    if not needed:
        return [None] * len(modules)
    if shares is None or len(shares) == 1:  # one rank trains on every row
        rows, split = torch.arange(len(rollout.rewards)), None
    else:
        split = scoring_split(rollout.lengths, len(shares))
        rows = split[rank]
    scored = []
    for module in needed:
        lockstep = split is not None and wrap.is_fsdp(module) and not packed
        calls = lockstep_calls(split, rollout.lengths, rollout.prompt_len) if lockstep else None
        logp = score_rows(policy, module, rollout, rows, calls, packed)  # (n, R), or a throwaway row's (1, R)
        scored.append(logp[: len(rows)])
    stacked = torch.stack(scored, dim=1)  # (n, M, R): the modules' scores travel together
    if split is not None:
        stacked = route(stacked, split, shares, rank)  # (S, M, R)
    out = iter(stacked.unbind(1))
    return [None if m is None else next(out) for m in modules]
