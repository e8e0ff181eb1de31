"""The objectives the audit speaks: what each loss is called with, and how its weights are read off.

Every objective is a sum of per-token terms with a weight each, J = sum w[i, t] * l[i, t], and the
audit reads w off the gradient of the step at a point where the slope of l is known exactly:

    objective  the loss is called with                        the point        g[i, t] =
    grpo       logp, old_logp, advantages, mask               on policy        -A_i * w
    sft        logp, mask (log-probs of the labels)           any              -w
    dpo        chosen_logp, rejected_logp, ref_chosen_logp,   pi = pi_ref      -/+ (beta / 2) * w
               ref_rejected_logp, chosen_mask, rejected_mask

so each row i of the synthetic minibatch carries a slope a_i and w = -g / a_i (``slopes``). GRPO
reads twice, with both signs of the advantages, and keeps the part that flips with them
(``gradnorm.audit.measurement``). A DPO minibatch is P pairs laid out as 2P rows, pair p's chosen
response in row 2p and its rejected one in row 2p + 1; every split keeps a pair's two rows
together (``unit_size``), and at pi = pi_ref the margin is 0, where -log sigmoid(beta * m) has
slope -beta/2 (``gradnorm.core.pairs.dpo_losses``). A DPO token's weight is then its pair's
weight v_p (summed log-probs) or v_p / |y| (length-normalized).

The modes each objective is compared with are its own: GRPO's table, SFT's (no groups), and
DPO's pair modes, each with a length-normalized twin (``mode_weights``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gradnorm.core.modes import MODE_NAMES
from gradnorm.core.pairs import pair_weights
from gradnorm.core.sharding import Plan
from gradnorm.core.simulate import effective_weights

OBJECTIVES = ("grpo", "sft", "dpo")
DEFAULT_BETA = 0.1
"""The beta the audit assumes a DPO loss uses (``--beta``), when the loss does not ask for it by name."""


@dataclass(frozen=True)
class Objective:
    """One objective's contract with the audit."""

    name: str
    arguments: tuple[str, ...]  # the loss's positional arguments, in order
    keywords: dict[str, str]  # what the loss may ask for by name, and what it holds
    modes: tuple[str, ...]  # the modes it is compared with, in order of preference
    unit: str  # what a microbatch holds a number of: "sequence" or "pair"
    unit_size: int  # rows a unit spans (a DPO pair: 2)
    wrong_sign: str  # what a negative weight on a counted token means

    def describe(self) -> str:
        """The contract in one sentence, for --help and for a loss that breaks it."""
        return (f"LOSS({', '.join(self.arguments)}, **counts) returns the scalar you backpropagate; it gets, by keyword "
                f"name, any of: {', '.join(self.keywords)}")


_SPLIT_KEYWORDS = {
    "world_size": "W: data-parallel ranks",
    "accum_steps": "A: this rank's microbatches per optimizer step (under a token budget, each rank's own)",
}

GRPO_KEYWORDS = {
    "ref_logp": "(n, T) reference log-probs; equal to logp here, so a k2/k3 KL has zero gradient (a loss that "
                "names its terms gets logp - 0.1, so a KL term has a gradient to measure)",
    "num_tokens": "N: response tokens of the whole minibatch (all ranks, all microbatches) the loss should count",
    "num_sequences": "S_tok: sequences of the minibatch with at least one response token",
    "num_groups": "N_groups: prompt groups of the minibatch with at least one response token",
    "group_tokens": "(k,) int64: N_g(i), the minibatch's token count of each sequence's group",
    "group_ids": "(k,) int64: the global prompt-group index of each sequence",
    **_SPLIT_KEYWORDS,
    "sequence_ids": "(n, T) int64: which of the call's k sequences each position belongs to (-1: a packed "
                    "row's padding); row i is sequence i unless rows are packed",
    "sequence_tokens": "(k,) int64: |o_i|, the tokens of each sequence the loss should count (all its chunks)",
    "num_response_tokens": "every generated token of the minibatch, dropped ones included",
    "truncated": "(k,) bool: responses cut at max_new_tokens",
    "rejected": "(n, T) bool: tokens a rejection (importance-sampling) mask drops",
    "context_parallel": "K: ranks each sequence is split over (1 without context parallelism)",
    "pipeline_microbatches": "P: pipeline microbatches a microbatch is cut into (1 without a pipeline)",
}

SFT_KEYWORDS = {
    "num_tokens": "N: label tokens of the whole minibatch (all ranks, all microbatches)",
    "num_sequences": "S_tok: sequences of the minibatch with at least one label token",
    **_SPLIT_KEYWORDS,
    "sequence_ids": GRPO_KEYWORDS["sequence_ids"],
    "sequence_tokens": "(k,) int64: |y_i|, the label tokens of each sequence (all its chunks)",
    "context_parallel": GRPO_KEYWORDS["context_parallel"],
    "pipeline_microbatches": GRPO_KEYWORDS["pipeline_microbatches"],
}

DPO_KEYWORDS = {
    "num_pairs": "P: preference pairs of the whole minibatch (all ranks, all microbatches)",
    "num_tokens": "response tokens of the whole minibatch, chosen and rejected",
    "chosen_tokens": "(n,) int64: |y+| of each pair's chosen response",
    "rejected_tokens": "(n,) int64: |y-| of each pair's rejected response",
    "beta": "the DPO temperature the audit reads the weights with (--beta)",
    **_SPLIT_KEYWORDS,
}

GRPO = Objective("grpo", ("logp", "old_logp", "advantages", "mask"), GRPO_KEYWORDS, MODE_NAMES, "sequence", 1,
                 "your loss rises where the advantage is positive: you return the objective, or swapped logp and "
                 "old_logp")
SFT = Objective("sft", ("logp", "mask"), SFT_KEYWORDS, ("local", "token", "sequence", "constant"), "sequence", 1,
                "your loss rises with the labels' log-probs: you return the log-likelihood, not its negative")
DPO = Objective("dpo", ("chosen_logp", "rejected_logp", "ref_chosen_logp", "ref_rejected_logp", "chosen_mask",
                        "rejected_mask"), DPO_KEYWORDS,
                ("pair", "local", "pair normalized", "local normalized"), "pair", 2,
                "your loss falls as the chosen response loses probability against the rejected one: chosen and "
                "rejected swapped, or the log-sigmoid's sign")
BY_NAME = {o.name: o for o in (GRPO, SFT, DPO)}


def get(name: str) -> Objective:
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown objective {name!r}: expected one of {', '.join(OBJECTIVES)}") from None


def slopes(objective: Objective, advantages: Tensor, beta: float) -> Tensor:
    """a (S,): each row's d(-l)/d(logp) per unit of weight at the audit's point, so that w = -g / a.

    GRPO: the advantage. SFT: 1 (l = -log p). DPO: beta/2 on chosen rows, -beta/2 on rejected ones.
    """
    if objective.name == "grpo":
        return advantages
    ones = torch.ones(len(advantages), dtype=torch.float64)
    if objective.name == "sft":
        return ones
    return ones * (beta / 2) * torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(len(advantages) // 2)


def mode_weights(objective: Objective, mode: str, mask: Tensor, group_ids: Tensor, num_groups: int, plan: Plan,
                 constant: float) -> Tensor:
    """(S, T) the weights ``mode`` gives under ``plan``, counting ``mask``; "constant" uses C.

    Only the ``local`` modes depend on the plan: 1 / (W * A_r * n[r, m]) with n the tokens (GRPO,
    SFT) or the pairs (DPO) of the microbatch, written out because a token budget gives ranks
    different numbers A_r of microbatches. The others are the same under any plan.
    """
    if objective.name == "dpo":
        return _pair_mode_weights(mode, mask, plan)
    if mode != "local":
        den = constant if mode == "constant" else mode
        return effective_weights(mask, group_ids, num_groups, den, [[torch.arange(len(mask))]])
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for rank in plan:
        for mb in rank:
            local_tokens = int(mask[mb].sum())
            if local_tokens:
                out[mb] = mask[mb].double() / (len(plan) * len(rank) * local_tokens)
    return out


def _pair_mode_weights(mode: str, mask: Tensor, plan: Plan) -> Tensor:
    """DPO's modes: each pair's weight v_p from ``gradnorm.core.pairs.pair_weights`` on every token of
    both its responses, divided by the response's |y| when ``normalized``. Rows 2p and 2p + 1 are pair p.
    """
    base, _, normalized = mode.partition(" ")
    per_token = mask.double()
    if normalized:
        per_token = per_token / mask.sum(-1, keepdim=True).clamp(min=1)
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for rank in plan:
        for mb in rank:
            v = pair_weights(len(mb) // 2, base, world_size=len(plan), accum_steps=len(rank),
                             num_pairs=len(mask) // 2, dtype=torch.float64)  # (pairs of mb,)
            out[mb] = per_token[mb] * v.repeat_interleave(2).unsqueeze(-1)
    return out
