"""From the probe head's gradient and the recorded inputs to every token's weight and every rank's share (pure).

At the first step the head H is 0, so every position's next-token distribution is uniform and, for
any loss whose per-position gradient in the logits is w * a * (p - e_y) (``gradnorm.audit.trainer.model``),

    value(k, y) = dH[SINK, k] - dH[y, k] = sum over positions (k -> y) of w * a.

A data set's slots are distinct (k, y) pairs, so value(slot) is that token's w * a, and
w = value / a with a the objective's slope at the probe's point: 1 for SFT's cross-entropy,
+beta/2 on a DPO pair's chosen response and -beta/2 on its rejected one (policy = reference, so
the margin is 0 and the sigmoid's slope is 1/2). Whatever the gradient holds beyond the slots
(a trainer that trains on its prompt or its padding) is ``Readout.stray``.

Which rank and microbatch read each unit comes from the recorded inputs: every content id belongs
to one unit, so the ids of one recorded forward name the units of that microbatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gradnorm.audit.trainer.data import ProbeData
from gradnorm.audit.trainer.model import EOS, sink


class ReadoutError(ValueError):
    """The recorded run cannot be read: what the trainer did that the probe cannot measure, in one line."""


@dataclass
class Readout:
    """One configuration's measurement: weights, the plan the trainer ran, and what it read."""

    values: Tensor  # (rows, T) float64: w * a of every slot
    mask: Tensor  # (rows, T) bool: the slots the loss should count (an EOS slot only if the trainer appended EOS)
    plan: list[list[Tensor]]  # plan[r][m]: the rows rank r's m-th forward read (both rows of a DPO pair)
    stray: float  # sum |value| outside the slots, as a share of sum |value| over them
    ranks_agree: bool  # every rank took the same gradient (DDP's all-reduce happened)


def slot_table(data: ProbeData) -> tuple[Tensor, Tensor, Tensor]:
    """(rows, T) input ids, labels and the slots' existence, T the longest row's slot count."""
    T = max(len(r) for r in data.rows)
    ids = torch.zeros(len(data.rows), T, dtype=torch.long)
    labels = torch.zeros_like(ids)
    exists = torch.zeros(len(data.rows), T, dtype=torch.bool)
    for i, row in enumerate(data.rows):
        ids[i, : len(row)] = torch.tensor([s.input_id for s in row])
        labels[i, : len(row)] = torch.tensor([s.label for s in row])
        exists[i, : len(row)] = True
    return ids, labels, exists


def step_gradient(records: list[dict]) -> tuple[Tensor, bool]:
    """(rank 0's head gradient before the trainer's clip, whether every rank took the same one).

    The recorder kept the clip's factor; dividing it out gives what the loss and the accumulation
    made. A launch with no record, or a record without a gradient, is the trainer's failure to say.
    """
    if not records:
        raise ReadoutError("the trainer never stepped its optimizer: no rank reached an optimizer step")
    missing = [r["rank"] for r in records if r["grad"] is None]
    if missing:
        raise ReadoutError(f"rank {missing[0]} stepped its optimizer before the probe model had a gradient: is the "
                           "model the trainer trains the one loaded from the probe directory?")
    grads = [r["grad"] / r.get("clip", 1.0) for r in records]
    return grads[0], all(torch.allclose(g, grads[0], rtol=1e-5, atol=0) for g in grads[1:])


def read(data: ProbeData, records: list[dict]) -> Readout:
    """The readout of one run from its ranks' records (``gradnorm.audit.trainer.recorder``), ordered by rank."""
    grad, ranks_agree = step_gradient(records)
    ids, labels, exists = slot_table(data)
    V = data.vocab_size
    if grad.shape != (V, V):
        raise ReadoutError(f"the probe head's gradient has shape {tuple(grad.shape)}, expected ({V}, {V}): did the "
                           "trainer resize the embeddings (a tokenizer that added tokens)?")
    D = grad[sink(V)].unsqueeze(0) - grad  # (V, V): D[y, k] = value(k, y)
    values = torch.where(exists, D[labels, ids], 0.0)  # (rows, T)
    inside = torch.zeros(V, V, dtype=torch.bool)
    inside[labels[exists], ids[exists]] = True
    inside[sink(V)] = True
    total = float(values.abs().sum())
    stray = float(D[~inside].abs().sum()) / total if total > 0 else 0.0
    plan, seen = _plan(data, records)
    if len(seen) < data.num_units:
        missing = sorted(set(range(data.num_units)) - seen)
        raise ReadoutError(f"the optimizer stepped before the trainer had read the whole probe data set ({len(seen)} of "
                           f"{data.num_units} units; first unread: {missing[0]}): one optimizer step must span it, "
                           "world size x accumulation steps x per-device batch = the data set's size")
    eos_fed = _eos_fed(data, records)
    mask = exists & ((labels != EOS) | eos_fed)
    return Readout(values, mask, plan, stray, ranks_agree)


def _plan(data: ProbeData, records: list[dict]) -> tuple[list[list[Tensor]], set[int]]:
    """plan[r][m]: the rows of the units rank r's m-th forward read; the units read by any."""
    rows_of: dict[int, list[int]] = {}
    for i, u in enumerate(data.units):
        rows_of.setdefault(u, []).append(i)
    plan, seen = [], set()
    for record in records:
        rank_plan = []
        for forward in record["forwards"]:
            units = sorted({data.owner[i] for i in forward.reshape(-1).tolist() if i in data.owner})
            if not units:
                continue
            seen.update(units)
            rank_plan.append(torch.tensor([i for u in units for i in rows_of[u]], dtype=torch.long))
        plan.append(rank_plan)
    return plan, seen


def _eos_fed(data: ProbeData, records: list[dict]) -> Tensor:
    """(rows, 1) bool: whether a recorded input had the row's last id followed by EOS (the trainer appends EOS)."""
    followed: set[int] = set()
    for record in records:
        for forward in record["forwards"]:
            flat = forward.reshape(-1, forward.shape[-1])
            hits = (flat[:, 1:] == EOS).nonzero()
            followed.update(flat[hits[:, 0], hits[:, 1]].tolist())
    last = torch.tensor([row[-1].input_id for row in data.rows])
    return torch.tensor([int(k) in followed for k in last]).unsqueeze(-1)
