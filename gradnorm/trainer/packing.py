"""Packed rows: a microbatch without padding. Sequences are laid end to end in a few rows of
fixed widths, positions restart at each one and attention stays inside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from gradnorm.models.tinygpt import token_logprobs_and_entropy

# Packed rows: a microbatch without padding.


ROW_WIDTHS = 4
"""A packed row holds as many positions as this many rows of the padded batch (``pack``)."""


@dataclass
class PackedRows:
    """A microbatch's sequences concatenated into r rows of C positions (a few padded rows' width).

    Each sequence is its prompt without left padding, then its response (|o_i| tokens); sequences
    fill the rows first fit, in order, and the ends of rows are filler (segment -1, never attended
    to by a sequence and never scored).
    """

    tokens: Tensor  # (r, C) long
    position_ids: Tensor  # (r, C) 0, 1, ... restarting at every sequence (0 on filler)
    segment_ids: Tensor  # (r, C) which sequence of the microbatch a position holds; -1 on filler
    keep: tuple[Tensor, Tensor]  # (row, col) of the K positions whose logits predict a response token
    targets: Tensor  # (K,) the response tokens they predict
    out: tuple[Tensor, Tensor]  # (sequence, response position) of each of the K predictions

    @property
    def positions(self) -> int:
        """The positions a forward over these rows computes, r * C."""
        return self.tokens.numel()


class PacksRows(Protocol):
    """What packed scoring asks of a policy (``gradnorm.trainer.policy.Policy`` has it)."""

    def packed_logits(self, module: nn.Module, rows: PackedRows) -> Tensor: ...


def pack(tokens: Tensor, prompt_len: int, lengths: Tensor, pad_id: int | None = None,
         rows_of: int = ROW_WIDTHS) -> PackedRows:
    """``tokens`` (n, P + R) of a microbatch, with response lengths ``lengths`` (n,), as packed rows.

    With ``pad_id`` the leading run of it in each prompt is left padding and is dropped. Rows are
    ``rows_of`` times as wide as the batch (``ROW_WIDTHS``): wider rows leave less filler at their
    ends, and cost more attention per token (each position attends within its row's mask).
    """
    n, width = tokens.shape
    P, device = prompt_len, tokens.device
    lengths = lengths.to(device=device, dtype=torch.long)
    if pad_id is None:
        starts = torch.zeros(n, dtype=torch.long, device=device)
    else:  # the left padding of each prompt: its leading run of PAD ids
        starts = (torch.cumsum(tokens[:, :P] != pad_id, dim=1) == 0).sum(1)
    spans = P + lengths - starts  # (n,) tokens of each sequence: its real prompt, then its response
    # as wide as a few padded rows, never wider than the whole microbatch (one row then holds it all)
    capacity = max(min(rows_of * width, int(spans.sum())), int(spans.max())) if n else 1
    room, row_of, offset_of = [], [], []  # first fit, in the microbatch's order (cheap: n integers)
    for span in spans.tolist():
        row = next((k for k, free in enumerate(room) if free >= span), None)
        if row is None:
            row = len(room)
            room.append(capacity)
        row_of.append(row)
        offset_of.append(capacity - room[row])
        room[row] -= span
    r = max(len(room), 1)
    # Every position of every sequence at once: sequence i's j-th token goes to (row_i, offset_i + j).
    seq = torch.repeat_interleave(torch.arange(n, device=device), spans)  # (L,) which sequence
    first = torch.cumsum(spans, 0) - spans  # (n,) where each sequence starts in the flat order
    j = torch.arange(len(seq), device=device) - first[seq]  # (L,) position inside its sequence
    row = torch.tensor(row_of, dtype=torch.long, device=device)[seq]
    col = torch.tensor(offset_of, dtype=torch.long, device=device)[seq] + j
    packed = torch.zeros(r, capacity, dtype=tokens.dtype, device=device)
    packed[row, col] = tokens[seq, starts[seq] + j]
    position_ids = torch.zeros(r, capacity, dtype=torch.long, device=device)
    position_ids[row, col] = j
    segment_ids = torch.full((r, capacity), -1, dtype=torch.long, device=device)
    segment_ids[row, col] = seq
    # Position j of sequence i predicts its token j + 1: a response token when j + 1 >= its prompt.
    prompt = (P - starts)[seq]  # (L,) the sequence's real prompt length
    predicts = (j >= prompt - 1) & (j <= spans[seq] - 2)
    keep = (row[predicts], col[predicts])
    return PackedRows(tokens=packed, position_ids=position_ids, segment_ids=segment_ids, keep=keep,
                      targets=packed[keep[0], keep[1] + 1], out=(seq[predicts], (j - prompt + 1)[predicts]))


def score_packed(policy: PacksRows, module: nn.Module, tokens: Tensor, prompt_len: int,
                 lengths: Tensor) -> tuple[Tensor, Tensor]:
    """(logp, entropy), each (n, R) as ``score_by_length`` returns them, from one packed forward.

    Inside the response mask the values equal the padded ones to fp32 rounding; outside it they
    are 0. Differentiable.
    """
    n, R = tokens.shape[0], tokens.shape[1] - prompt_len
    rows = pack(tokens, prompt_len, lengths, policy.pad_id)
    logits = policy.packed_logits(module, rows)  # (r, C, V)
    logp, entropy = token_logprobs_and_entropy(logits[rows.keep], rows.targets)  # (K,) each, fp32
    out_logp = logp.new_zeros(n, R).index_put(rows.out, logp)
    out_entropy = entropy.new_zeros(n, R).index_put(rows.out, entropy)
    return out_logp, out_entropy
