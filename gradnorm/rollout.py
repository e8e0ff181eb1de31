"""Rollouts: sample G completions per prompt, score them, and turn rewards into group advantages.

The rule that makes the whole trainer invariant to the world size W, the accumulation steps A and
the sharding: **the rollout batch of step k is a function of (seed, k, weights) only.** Every rank
generates the *whole* global batch with a generator seeded from (seed, k) and later keeps only the
sequences its sharding plan assigns it. That costs W-fold generation, which is nothing for the tiny
default model; at scale one would seed each sequence from (seed, k, index) or generate on one rank
and scatter. Either way the global batch must be bit-identical for W = 1 and W = 2 (tested).

The response mask M[i, t] marks the tokens the policy actually emitted: every position up to and
including the first EOS (all positions when there is none, i.e. a truncated response). It is NOT
``tokens != pad``: an untrained policy may sample the PAD id itself before stopping, and that
token is as much its choice as any other.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gradnorm import hfmodels
from gradnorm.grpo import group_advantages
from gradnorm.tasks import RepeatTask
from gradnorm.tinygpt import generate


def seeded_generator(seed: int, *keys: object, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator whose state is a function of (seed, *keys) alone, e.g. (seed, "rollout", step).

    The keys are hashed rather than added, so (seed, step) never collides with (seed + 1, step - 1).
    """
    digest = hashlib.sha256(repr((seed, *keys)).encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def sampler_for(model: nn.Module):
    """TinyGPT's ``generate``, or its Hugging Face twin (same signature) for a transformers model."""
    return hfmodels.generate if hfmodels.is_hf_model(model) else generate


def response_mask(responses: Tensor, eos_id: int) -> Tensor:
    """M (S, R) bool: True up to and including each row's first EOS; the whole row if it has none."""
    is_eos = (responses == eos_id).long()  # (S, R)
    eos_before = torch.cumsum(is_eos, dim=1) - is_eos  # EOS tokens strictly before position t
    return eos_before == 0


def check_rewards(rewards: object, num_sequences: int) -> Tensor:
    """The reward function's output as a float32 (S,) tensor, or a one-line ValueError saying why not.

    A reward that is NaN or inf, or of the wrong shape, would turn every advantage of its group
    (and then the weights) into NaN, or silently misalign rewards with sequences: refuse it here.
    """
    if not isinstance(rewards, Tensor):
        raise ValueError(f"reward function returned {type(rewards).__name__}, expected a tensor of shape "
                         f"({num_sequences},); fix the task's reward()")
    if tuple(rewards.shape) != (num_sequences,):
        raise ValueError(f"reward function returned shape {tuple(rewards.shape)}, expected ({num_sequences},) "
                         "(one reward per sequence); fix the task's reward()")
    bad = ~torch.isfinite(rewards.float())
    if bad.any():
        first = int(bad.nonzero()[0])
        raise ValueError(f"reward function returned {int(bad.sum())} non-finite reward(s) (sequence {first}: "
                         f"{float(rewards[first])}); rewards must be finite numbers, fix the task's reward()")
    return rewards.float()


@dataclass
class Rollout:
    """One global rollout batch: num_prompts groups of G consecutive completions.

    Responses are cut to the longest response of the batch (R <= max_new_tokens columns), so the
    training forward pass never runs over columns that are padding in every row.
    """

    tokens: Tensor
    """(S, P + R) long: prompt then response; PAD after the first EOS."""
    mask: Tensor
    """(S, R) bool: the response mask M (up to and including the first EOS)."""
    rewards: Tensor
    """(S,) float32 in [0, task.max_reward]."""
    advantages: Tensor
    """(S,) float32: group-normalized rewards A_i."""
    group_ids: Tensor
    """(S,) long: the prompt group of each sequence, 0..num_groups-1."""
    group_size: int
    """G: completions per prompt."""
    prompt_len: int
    """P: prompt tokens in front of every response."""

    @property
    def lengths(self) -> Tensor:
        """|o_i| (S,): response tokens of each sequence, from the mask (derived)."""
        return self.mask.sum(-1)

    @property
    def num_groups(self) -> int:
        """Number of prompt groups in the batch (derived)."""
        return len(self.rewards) // self.group_size

    def groups(self, first: int, count: int) -> Rollout:
        """The sub-batch of prompt groups [first, first + count), renumbered from 0 (a PPO minibatch)."""
        rows = slice(first * self.group_size, (first + count) * self.group_size)
        return Rollout(
            tokens=self.tokens[rows], mask=self.mask[rows], rewards=self.rewards[rows],
            advantages=self.advantages[rows], group_ids=self.group_ids[rows] - first,
            group_size=self.group_size, prompt_len=self.prompt_len,
        )

    def digest(self) -> str:
        """A short hash of the sampled tokens: equal digests mean bit-identical rollouts."""
        return hashlib.sha256(self.tokens.cpu().numpy().tobytes()).hexdigest()[:16]


@torch.no_grad()
def generate_rollout(
    model: nn.Module,
    task: RepeatTask,
    *,
    num_prompts: int,
    group_size: int,
    seed: int,
    step: int,
    temperature: float,
    scale_by_std: bool = True,
) -> Rollout:
    """Sample the global rollout batch of ``step``: a pure function of (seed, step, weights).

    ``model`` must be the plain module (not the DDP wrapper): sampling is no part of the gradient
    and must not trigger DDP's hooks. Prompts are drawn from a CPU generator and tokens from one
    on the model's device, both seeded from (seed, step).
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    prompts, answers = task.sample_prompts(num_prompts, seeded_generator(seed, "prompts", step))
    prompts = prompts.repeat_interleave(group_size, dim=0).to(device)  # (S, P), groups consecutive
    answers = [a for a in answers for _ in range(group_size)]
    tokens = sampler_for(model)(
        model, prompts, task.max_new_tokens, task.tokenizer.eos_id, task.tokenizer.pad_id,
        temperature=temperature, generator=seeded_generator(seed, "sample", step, device=device),
    )  # (S, P + max_new_tokens)
    model.train(was_training)
    P = task.prompt_len
    mask = response_mask(tokens[:, P:], task.tokenizer.eos_id)  # (S, max_new_tokens)
    width = max(int(mask.sum(-1).max()), 1)  # R: the longest response of the batch
    rewards = check_rewards(task.reward(tokens[:, P:].cpu(), answers), len(tokens)).to(device)  # (S,)
    return Rollout(
        tokens=tokens[:, : P + width], mask=mask[:, :width], rewards=rewards,
        advantages=group_advantages(rewards, group_size, scale_by_std),
        group_ids=torch.arange(len(rewards), device=device) // group_size,
        group_size=group_size, prompt_len=P,
    )


@torch.no_grad()
def sampled_reward(model: nn.Module, task: RepeatTask, num_prompts: int, temperature: float, seed: int) -> float:
    """Mean reward of one sampled response per prompt on a fixed prompt set (seeded by ``seed``)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    prompts, answers = task.sample_prompts(num_prompts, seeded_generator(seed, "eval-prompts"))
    tokens = sampler_for(model)(
        model, prompts.to(device), task.max_new_tokens, task.tokenizer.eos_id, task.tokenizer.pad_id,
        temperature=temperature, generator=seeded_generator(seed, "eval-sample", device=device),
    )
    model.train(was_training)
    return float(task.reward(tokens[:, task.prompt_len :].cpu(), answers).mean())
