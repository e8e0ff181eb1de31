"""Length bias: how each exact denominator weighs long against short, correct against wrong (notebook 04).

One rank, one microbatch: only the weights matter. ``length_weights`` gives every response's
per-token and total weight under each mode, ``correct_vs_wrong`` the push on a correct and on a
wrong token of one prompt group, ``batch_dependence`` how one response's weight moves with the
other responses of its minibatch. Weights come from ``imbalance.token_layout``, advantages from
``grpo.group_advantages``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gradnorm.core.grpo import group_advantages
from gradnorm.teach.imbalance import Layout, ShardedBatch, as_shares, token_layout
from gradnorm.core.modes import INVARIANT_MODES


@dataclass(frozen=True)
class LengthWeights:
    """One minibatch on one rank: each sequence's per-token weight and total weight per mode."""

    lengths: np.ndarray  # (S,)
    group_ids: np.ndarray  # (S,)
    max_new_tokens: int
    token_weight: dict[str, np.ndarray]  # mode -> (S,) w of each of the sequence's tokens
    total_weight: dict[str, np.ndarray]  # mode -> (S,) |o_i| * w: the sequence's weight in J

    def share(self, mode: str) -> np.ndarray:
        """(S,) each sequence's share of the update (total weights normalized to sum 1)."""
        return as_shares(self.total_weight[mode])

    def group_share(self, mode: str) -> np.ndarray:
        """(G,) each prompt group's share of the update."""
        return np.bincount(self.group_ids, weights=self.share(mode))


def staircase_lengths(num_groups: int = 4, group_size: int = 4, step: int = 4) -> list[int]:
    """Prompt g's responses have (g+1) * step * (1, 2, ..., group_size) tokens: short and long
    responses within every prompt, and prompts whose responses are longer overall."""
    return [(g + 1) * step * (i + 1) for g in range(num_groups) for i in range(group_size)]


def length_weights(
    lengths: Sequence[int], group_size: int, modes: Sequence[str] = INVARIANT_MODES, max_new_tokens: int | None = None
) -> LengthWeights:
    """Per-token and per-sequence weights of every mode for one minibatch (W = A = 1).

    Sequences come in consecutive prompt groups of ``group_size``. ``max_new_tokens`` sets Dr
    GRPO's constant (default: the longest response).
    """
    lengths_t = torch.as_tensor(lengths, dtype=torch.int64)
    max_new_tokens = int(lengths_t.max()) if max_new_tokens is None else max_new_tokens
    batch = ShardedBatch(lengths_t, torch.arange(len(lengths_t)) // group_size,
                      -(-len(lengths_t) // group_size), [[torch.arange(len(lengths_t))]])
    per_token = {m: _by_sequence(token_layout(batch, m, max_new_tokens)) for m in modes}
    length = lengths_t.numpy()
    return LengthWeights(
        lengths=length, group_ids=batch.group_ids.numpy(), max_new_tokens=max_new_tokens,
        token_weight=per_token, total_weight={m: w * length for m, w in per_token.items()},
    )


def _by_sequence(layout: Layout) -> np.ndarray:
    out = np.zeros(len(layout.sequence))
    out[layout.sequence] = layout.weight
    return out


@dataclass(frozen=True)
class CorrectVsWrong:
    """One prompt group: k correct responses of one length, G - k wrong ones of another.

    With the importance ratio at 1 (first step on fresh samples) the GRPO gradient raises the
    log-prob of each token of response i by w_i * A_i: its *push*. Correct responses have A > 0
    (pushed up), wrong ones A < 0 (pushed down).
    """

    correct_len: int
    wrong_len: int
    num_correct: int
    group_size: int
    advantage_correct: float
    advantage_wrong: float
    tokens: int  # N: the group's tokens, the unit 1/N of the pushes (it changes with the lengths)
    push_per_token: dict[str, tuple[float, float]]  # mode -> (correct token, wrong token), in units of 1/N
    update_share: dict[str, tuple[float, float]]  # mode -> share of sum |push| on (correct, wrong) responses


def correct_vs_wrong(
    correct_len: int, wrong_len: int, num_correct: int = 4, group_size: int = 8,
    modes: Sequence[str] = INVARIANT_MODES, max_new_tokens: int = 64, scale_by_std: bool = True,
) -> CorrectVsWrong:
    """The push on a correct and on a wrong token under each mode, and how |push| splits.

    Pushes are reported in units of 1/N (multiplied by the minibatch's token count), the token
    mode's weight, so that ``token`` reads as the bare advantages and the other modes as how far
    they depart from it.
    """
    if not 0 < num_correct < group_size:
        raise ValueError(f"need 0 < num_correct < group_size, got {num_correct} of {group_size}")
    if max(correct_len, wrong_len) > max_new_tokens:
        raise ValueError(f"responses cannot be longer than max_new_tokens = {max_new_tokens}")
    lengths = [correct_len] * num_correct + [wrong_len] * (group_size - num_correct)
    rewards = torch.tensor([1.0] * num_correct + [0.0] * (group_size - num_correct), dtype=torch.float64)
    adv = group_advantages(rewards, group_size, scale_by_std=scale_by_std).numpy()  # (G,)
    view = length_weights(lengths, group_size, modes, max_new_tokens)
    tokens = sum(lengths)
    push, share = {}, {}
    for m in modes:
        w = view.token_weight[m]
        push[m] = (float(w[0] * adv[0] * tokens), float(w[-1] * adv[-1] * tokens))
        total = np.abs(view.total_weight[m] * adv)
        s = as_shares(np.array([total[:num_correct].sum(), total[num_correct:].sum()]))
        share[m] = (float(s[0]), float(s[1]))
    return CorrectVsWrong(
        correct_len=correct_len, wrong_len=wrong_len, num_correct=num_correct, group_size=group_size,
        advantage_correct=float(adv[0]), advantage_wrong=float(adv[-1]), tokens=tokens, push_per_token=push, update_share=share,
    )


@dataclass(frozen=True)
class BatchDependence:
    """The per-token weight of one fixed response as the rest of its minibatch grows longer."""

    own_length: int
    other_length: np.ndarray  # (K,) the length of every other response of the minibatch
    token_weight: dict[str, np.ndarray]  # mode -> (K,) the fixed response's per-token weight


def batch_dependence(
    other_lengths: Sequence[int], own_length: int = 16, num_sequences: int = 16, group_size: int = 4,
    modes: Sequence[str] = INVARIANT_MODES, max_new_tokens: int = 64,
) -> BatchDependence:
    """Sequence 0 keeps ``own_length`` tokens while every other response has ``other_length``.

    Under ``token`` its tokens weigh 1/N, so they count less when the *other* responses are long;
    under ``group`` only its own group matters; ``sequence`` and a constant ignore the others.
    """
    weights = {m: [] for m in modes}
    for other in other_lengths:
        lengths = [own_length] + [int(other)] * (num_sequences - 1)
        view = length_weights(lengths, group_size, modes, max_new_tokens)
        for m in modes:
            weights[m].append(view.token_weight[m][0])
    return BatchDependence(own_length=own_length, other_length=np.asarray(other_lengths),
                           token_weight={m: np.array(v) for m, v in weights.items()})
