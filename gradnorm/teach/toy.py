"""The toy GRPO problem every notebook, figure and test shares: a tiny policy and a ragged minibatch.

Pure: no torch.distributed, no processes. ``make_problem`` builds the same minibatch on every call
(and on every rank of a multi-process check), ``token_losses`` scores it with the trainer's GRPO
loss (clip-higher, k3 KL), so what the notebooks show is the loss the trainer optimizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gradnorm.core.denominators import mask_from_lengths
from gradnorm.core.grpo import TokenLosses, group_advantages, grpo_token_losses


@dataclass
class Problem:
    """A fixed GRPO minibatch with ragged response lengths; every rank builds the same one."""

    inputs: Tensor  # (S, T) tokens fed to the policy
    targets: Tensor  # (S, T) tokens whose log-prob is scored
    mask: Tensor  # (S, T) bool response mask
    group_ids: Tensor  # (S,) prompt group of each sequence
    num_groups: int
    old_logp: Tensor  # (S, T) log-probs under the policy that sampled
    ref_logp: Tensor  # (S, T) log-probs under the reference policy
    advantages: Tensor  # (S,)
    beta: float = 0.04

    @property
    def lengths(self) -> Tensor:
        return self.mask.sum(-1)


# 4 groups of 4 completions: group 0 is empty, group 1 short, groups 2 and 3 long.
DEFAULT_LENGTHS = (0, 0, 0, 0, 1, 2, 1, 3, 12, 9, 11, 7, 5, 12, 8, 10)


class TinyPolicy(nn.Module):
    """A small next-token policy: embedding -> tanh MLP -> logits. Enough to carry gradients."""

    def __init__(self, vocab: int = 16, hidden: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.mlp = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: Tensor) -> Tensor:  # (n, T) -> (n, T, V)
        return self.head(torch.tanh(self.mlp(self.embed(tokens))))


def make_policy(seed: int = 0, dtype: torch.dtype = torch.float64) -> TinyPolicy:
    torch.manual_seed(seed)
    return TinyPolicy().to(dtype)


def make_problem(
    lengths: Sequence[int] | None = None,
    group_size: int = 4,
    max_len: int = 12,
    vocab: int = 16,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> Problem:
    """Default: 4 groups of 4; group 0 has no response tokens at all, group 1 very few.

    Contiguous sharding over 4 ranks thus leaves rank 0 with no tokens, and any sharding puts
    very different token counts in different microbatches.
    """
    if lengths is None:
        lengths = DEFAULT_LENGTHS
    g = torch.Generator().manual_seed(seed)
    num_seq = len(lengths)
    inputs = torch.randint(vocab, (num_seq, max_len), generator=g)
    targets = torch.randint(vocab, (num_seq, max_len), generator=g)
    mask = mask_from_lengths(torch.tensor(lengths), max_len)
    # Draw everything in float64 and round once, so a float32 problem is the float64 one rounded.
    rewards = torch.rand(num_seq, generator=g, dtype=torch.float64)
    advantages = group_advantages(rewards, group_size)
    with torch.no_grad():
        logp = token_logp(make_policy(seed, torch.float64), inputs, targets)
    # Perturb the sampling policy so that some ratios leave the clip range on both sides.
    old_logp = logp + 0.3 * torch.randn(logp.shape, generator=g, dtype=torch.float64)
    ref_logp = logp + 0.1 * torch.randn(logp.shape, generator=g, dtype=torch.float64)
    advantages, old_logp, ref_logp = (x.to(dtype) for x in (advantages, old_logp, ref_logp))
    return Problem(
        inputs=inputs, targets=targets, mask=mask,
        group_ids=torch.arange(num_seq) // group_size, num_groups=num_seq // group_size,
        old_logp=old_logp, ref_logp=ref_logp, advantages=advantages,
    )


def token_logp(policy: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
    """log pi(targets | inputs) per token, (n, T)."""
    logits = policy(inputs)
    return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_losses(policy: nn.Module, problem: Problem, idx: Tensor) -> TokenLosses:
    """GRPO per-token losses of sequences ``idx`` (clip-higher 0.2 / 0.28, k3 KL)."""
    logp = token_logp(policy, problem.inputs[idx], problem.targets[idx])
    return grpo_token_losses(
        logp, problem.old_logp[idx], problem.advantages[idx],
        ref_logp=problem.ref_logp[idx], beta=problem.beta, clip_low=0.2, clip_high=0.28,
    )
