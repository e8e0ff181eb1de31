"""The splits a trainer makes of one minibatch, as the calls of the user's loss they produce.

A ``Layout`` is one configuration of one optimizer step: for every simulated rank, the forwards
(``Call``) it runs, each holding some positions of the (S, T) minibatch in rows of its own.
``measurement`` runs the loss once per call on a leaf gathered from those positions, multiplies what it
returns by the call's ``scale`` and adds each gradient back into its positions. Every factor
around the loss is linear (the loop's 1/A, a pipeline schedule's 1/P, a mean over W ranks or over
the K ranks of a context-parallel group), so applying it to the loss is the same as applying it
to the gradient. The axes, each beside core.sharding's fixed-count plans:

    token budget      each rank's sequences cut in order into microbatches of at most B response
                      tokens: ranks hold different numbers of sequences and of microbatches
    packing           a microbatch's responses laid back to back in rows of L positions (first
                      fit, in order); a row's tail is padding that belongs to no sequence
    context parallel  each row's T positions split over the K ranks of a group: K contiguous
                      chunks, or 2K chunks with chunks i and 2K-1-i on rank i (load-balanced)
    pipeline          each microbatch cut into P pipeline microbatches, whose losses the schedule
                      sums or averages (x 1/P)

core.sharding.validate_plan asks every rank for the same number of microbatches, as DDP does; a
token budget breaks that on purpose, so these plans are checked by ``check_plan`` here instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradnorm.core.sharding import Plan, make_plan

CP_LAYOUTS = ("contiguous", "two-chunk")
"""Context-parallel layouts: K contiguous chunks, or Megatron's load-balanced 2K chunks."""


@dataclass(frozen=True)
class Splits:
    """The axes simulated beside (W, A, sharding); None or 1 leaves an axis out."""

    microbatch_tokens: int | None = None
    """B: also cut each rank's sequences into microbatches of at most B response tokens."""
    pack: int | None = None
    """L: also pack each microbatch's responses into rows of L positions."""
    context_parallel: int = 1
    """K: also split each row over K ranks."""
    cp_layouts: tuple[str, ...] = CP_LAYOUTS
    """Which context-parallel layouts (``CP_LAYOUTS``)."""
    pipeline_microbatches: int | None = None
    """P: also cut each microbatch into P pipeline microbatches."""

    @property
    def granularity(self) -> int:
        """The factor every W*A is multiplied by when sizing the minibatch (P sequences a microbatch)."""
        return self.pipeline_microbatches or 1


@dataclass(frozen=True)
class Call:
    """One forward of the user's loss: rows of positions of the minibatch, on one rank."""

    rank: int  # flat rank: dp_rank * K + cp_rank
    index: Tensor  # (n, L) int64: position in the flattened (S*T,) minibatch; S*T: a packed row's padding
    sequence: Tensor  # (n, L) int64: which of ``sequences`` each slot belongs to, -1 on padding
    sequences: Tensor  # (k,) int64: the minibatch index of each sequence this call holds
    scale: float  # multiplies the returned loss: the loop's 1/A_r, the schedule's 1/P, the reductions' 1/W, 1/K
    accum_steps: int  # A_r: this rank's microbatches (the ``accum_steps`` keyword)
    where: str  # for error messages: "(rank 3, microbatch 1)"


@dataclass(frozen=True)
class Layout:
    """One configuration: its label, the data-parallel plan, and every call of the step."""

    label: str
    plan: Plan  # plan[r][m]: the sequences of data-parallel rank r's microbatch m (any number of m a rank)
    calls: tuple[Call, ...]
    num_ranks: int  # W * K
    axes: frozenset[str] = frozenset()  # of "budget", "pack", "cp", "pipeline"
    context_parallel: int = 1
    pipeline_microbatches: int = 1

    @property
    def world_size(self) -> int:
        return len(self.plan)

    @property
    def microbatch_counts(self) -> list[int]:
        """A_r of every data-parallel rank."""
        return [len(rank) for rank in self.plan]


@dataclass(frozen=True)
class Loop:
    """The factors around the loss: the outer loop's and the reductions' (``measurement.Convention``'s fields)."""

    scale_by_accum: bool = False
    reduction: str = "mean"  # over the W data-parallel ranks
    cp_reduction: str = "mean"  # over the K ranks of a context-parallel group
    pipeline_combine: str = "sum"  # of the P pipeline microbatches' losses


def check_plan(plan: Plan, num_sequences: int) -> None:
    """Every sequence exactly once, every rank at least one microbatch (counts may differ by rank)."""
    if not plan or any(len(rank) == 0 for rank in plan):
        raise ValueError("every rank must have at least one microbatch")
    seen = torch.cat([mb for rank in plan for mb in rank]).sort().values
    if not torch.equal(seen, torch.arange(num_sequences)):
        raise ValueError("a plan must assign every sequence exactly once")


def token_budget_plan(kind: str, lengths: Tensor, world_size: int, budget: int) -> Plan:
    """Ranks as ``kind`` assigns them (one microbatch each), then each rank's sequences cut in order
    into microbatches of at most ``budget`` response tokens (greedy: a new one when the next would not fit).

    Dynamic batching by tokens: a rank of short responses runs few microbatches, one of long ones many.
    """
    if int(lengths.max()) > budget:
        raise ValueError(f"a token budget of {budget} is below the longest response ({int(lengths.max())} tokens; "
                         "a DPO pair's: both of its responses)")
    plan = []
    for (held,) in make_plan(kind, lengths, world_size, 1):
        microbatches, current, load = [], [], 0
        for i in held.tolist():
            if current and load + int(lengths[i]) > budget:
                microbatches.append(current)
                current, load = [], 0
            current.append(i)
            load += int(lengths[i])
        microbatches.append(current)
        plan.append([torch.tensor(mb, dtype=torch.long) for mb in microbatches])
    return plan


def _rows(sequences: Tensor, lengths: Tensor, T: int, pack: int | None) -> tuple[Tensor, Tensor]:
    """(index, sequence), each (n, L): one row per sequence (L = T), or responses packed into rows of L = pack."""
    k = len(sequences)
    if pack is None:
        index = sequences.unsqueeze(-1) * T + torch.arange(T)  # (k, T)
        return index, torch.arange(k).unsqueeze(-1).expand(k, T).clone()
    rows: list[list[tuple[int, int]]] = [[]]  # (local id, length) of the responses in each row
    fill = 0
    for j, i in enumerate(sequences.tolist()):
        n = int(lengths[i])
        if fill + n > pack:  # first fit in order: the next response opens a new row
            rows.append([])
            fill = 0
        rows[-1].append((j, n))
        fill += n
    pad = len(lengths) * T  # one sink position for every padding slot; its gradient is dropped
    index = torch.full((len(rows), pack), pad, dtype=torch.long)
    sequence = torch.full((len(rows), pack), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        t = 0
        for j, n in row:
            index[r, t : t + n] = int(sequences[j]) * T + torch.arange(n)  # ALGO LOGIC: response j, back to back
            sequence[r, t : t + n] = j
            t += n
    return index, sequence


def _chunks(width: int, context_parallel: int, layout: str) -> list[Tensor]:
    """The columns each of the K ranks of a group holds."""
    if layout == "contiguous":
        return list(torch.tensor_split(torch.arange(width), context_parallel))
    pieces = torch.tensor_split(torch.arange(width), 2 * context_parallel)  # rank i: chunks i and 2K-1-i
    return [torch.cat([pieces[i], pieces[2 * context_parallel - 1 - i]]) for i in range(context_parallel)]


def build(label: str, plan: Plan, response_lengths: Tensor, T: int, loop: Loop, *, pack: int | None = None,
          context_parallel: int = 1, cp_layout: str = "contiguous", pipeline_microbatches: int | None = None,
          axes: frozenset[str] = frozenset()) -> Layout:
    """Every call of one step under ``plan`` with the asked axes, and the factor on each call's loss."""
    check_plan(plan, len(response_lengths))
    world_size, K, P = len(plan), context_parallel, pipeline_microbatches or 1
    calls = []
    for r, rank in enumerate(plan):
        for m, mb in enumerate(rank):
            scale = 1.0
            if loop.scale_by_accum:
                scale /= len(rank)  # the loop divides by this rank's own number of microbatches
            if loop.reduction == "mean":
                scale /= world_size  # DDP's mean over the data-parallel ranks
            if loop.cp_reduction == "mean":
                scale /= K  # the mean over the K ranks of a context-parallel group
            if pipeline_microbatches is not None and loop.pipeline_combine == "mean":
                scale /= P  # the schedule averages its P microbatches' losses
            if pipeline_microbatches and len(mb) < P:
                raise ValueError(f"a microbatch of {len(mb)} sequences cannot feed {P} pipeline microbatches")
            stages = torch.tensor_split(mb, P) if pipeline_microbatches else (mb,)
            for p, part in enumerate(stages):
                index, sequence = _rows(part, response_lengths, T, pack)
                columns = _chunks(index.shape[1], K, cp_layout) if K > 1 else [torch.arange(index.shape[1])]
                for c, cols in enumerate(columns):
                    where = f"rank {r}" + (f" (context-parallel rank {c})" if K > 1 else "") + f", microbatch {m}"
                    where += f", pipeline microbatch {p}" if pipeline_microbatches else ""
                    calls.append(Call(r * K + c, index[:, cols], sequence[:, cols], part, scale, len(rank),
                                      f"({where})"))
    return Layout(label, plan, tuple(calls), world_size * K, axes, K, P)


def expand_plan(plan: Plan, unit_size: int) -> Plan:
    """A plan over units (a DPO pair) -> the same plan over rows: unit u is rows u*k .. u*k + k - 1."""
    if unit_size == 1:
        return plan
    offsets = torch.arange(unit_size)
    return [[(mb.unsqueeze(-1) * unit_size + offsets).reshape(-1) for mb in rank] for rank in plan]


def layouts(response_lengths: Tensor, T: int, world_sizes: Sequence[int], accum_steps: Sequence[int],
            shardings: Sequence[str], splits: Splits, loop: Loop, unit_size: int = 1) -> list[Layout]:
    """The reference (one process, one microbatch, no axis), then every configuration asked for.

    Each data-parallel plan (fixed count for every (W, A), token budget for every W) comes plain and
    with each asked axis alone, and with all of them together when more than one is asked for; the
    pipeline is left out on a plan with a microbatch of fewer than P sequences (``balanced`` may have one).
    ``unit_size`` > 1: the plans split units of that many consecutive rows (a DPO pair's two
    responses), sharded and budgeted by the unit's tokens, and never cut a unit.
    """
    S = len(response_lengths)
    units = response_lengths.view(-1, unit_size).sum(-1) if unit_size > 1 else response_lengths
    reference = build("reference", [[torch.arange(S)]], response_lengths, T, loop)
    variants: list[tuple[str, dict, frozenset[str]]] = []
    if splits.pack:
        variants.append((f"packed {splits.pack}", {"pack": splits.pack}, frozenset({"pack"})))
    if splits.context_parallel > 1:
        variants += [(f"cp {layout}", {"context_parallel": splits.context_parallel, "cp_layout": layout},
                      frozenset({"cp"})) for layout in splits.cp_layouts]
    if splits.pipeline_microbatches:
        variants.append((f"pipeline {splits.pipeline_microbatches}",
                         {"pipeline_microbatches": splits.pipeline_microbatches}, frozenset({"pipeline"})))
    if len({axes for _, _, axes in variants}) > 1:  # all together (one cp layout: the balanced one)
        together = {k: v for _, kw, _ in variants for k, v in kw.items()}
        variants.append(("all axes", together, frozenset().union(*(a for _, _, a in variants))))
    plans: list[tuple[str, Plan, frozenset[str]]] = []
    for w in world_sizes:
        for a in accum_steps:
            if w * a > 1:
                plans += [(kind, expand_plan(make_plan(kind, units, w, a), unit_size), frozenset())
                          for kind in shardings]
        if splits.microbatch_tokens:
            plans += [(f"{kind} budget {splits.microbatch_tokens}",
                       expand_plan(token_budget_plan(kind, units, w, splits.microbatch_tokens), unit_size),
                       frozenset({"budget"})) for kind in shardings]
    plain = bool(plans)
    if not plans and variants:  # W = A = 1: the axes alone, on the reference's one microbatch
        plans = [("one process", [[torch.arange(S)]], frozenset())]
    out = [reference]
    for label, plan, axes in plans:
        if plain:  # (the one-process plan without an axis would be the reference again)
            out.append(build(label, plan, response_lengths, T, loop, axes=axes))
        for suffix, kw, more in variants:
            if min(len(mb) for rank in plan for mb in rank) < kw.get("pipeline_microbatches", 1):
                continue  # a microbatch packed by tokens may hold fewer sequences than a schedule's P
            out.append(build(f"{label} {suffix}", plan, response_lengths, T, loop, axes=axes | more, **kw))
    return out
