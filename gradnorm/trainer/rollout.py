"""Rollouts: sample G completions per prompt, score them, and turn rewards into group advantages.

The rule that makes the whole trainer invariant to the world size W, the accumulation steps A and
the sharding: **the rollout batch of step k is a function of (seed, k, weights) only.** Prompts
come from a generator seeded by (seed, k). Sequence i (prompt i // G) samples its tokens by
inverse CDF from its own row of uniforms, drawn from a generator seeded by (seed, k, i)
(``sequence_uniforms``; ``gradnorm.models.sampling``), so its tokens do not depend on which rank samples
it or which other sequences share its batch. Two ways to use that (``--rollouts``):

- sharded (default): rank r samples only its contiguous share of whole prompt groups
  (``group_split``: about S / W sequences), scores them, and ONE all_gather of tokens and rewards
  gives every rank the global batch, which the sharding plan then splits as if one process had
  sampled it. Generation shrinks with W.
- replicated: every rank samples the whole global batch itself (W-fold generation, no collective;
  the simplest thing to reason about, for teaching runs).

Both give the same global batch for any W, up to the rounding of the logits: a batch of S / W rows
may round a logit differently from a batch of S (another matmul kernel), and a one-ulp change can
flip a draw that sits on a CDF boundary. That is rare on CPU with one thread (tested bit for bit
at W = 1 and 2); with bf16 on GPUs expect more of it.

The response mask M[i, t] marks the tokens the policy actually emitted: every position up to and
including the first EOS (all positions when there is none, i.e. a truncated response). It is NOT
``tokens != pad``: an untrained policy may sample the PAD id itself before stopping, and that
token is as much its choice as any other.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from gradnorm.core.grpo import group_advantages
from gradnorm.dist import comm, wrap
from gradnorm.tasks import Task


def seeded_generator(seed: int, *keys: object, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator whose state is a function of (seed, *keys) alone, e.g. (seed, "rollout", step).

    The keys are hashed rather than added, so (seed, step) never collides with (seed + 1, step - 1).
    """
    digest = hashlib.sha256(repr((seed, *keys)).encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def sequence_uniforms(indices: range, num_positions: int, *keys: object) -> Tensor:
    """(len(indices), num_positions) float32 on the CPU: row j is a function of (*keys, indices[j]) only.

    E.g. ``sequence_uniforms(range(8, 16), R, seed, "sample", step)`` is the noise of sequences
    8..15 of step ``step``. One small generator per sequence (a hash and a seed: microseconds), so
    no sequence's noise depends on how many others were drawn before it.
    """
    rows = [torch.rand(num_positions, generator=seeded_generator(*keys, i)) for i in indices]
    return torch.stack(rows) if rows else torch.empty(0, num_positions)


def group_split(num_groups: int, world_size: int) -> list[range]:
    """The prompt groups each rank samples under --rollouts sharded: contiguous and as even as possible
    (the first num_groups % W ranks get one group more; with fewer groups than ranks some get none)."""
    base, extra = divmod(num_groups, world_size)
    starts = [r * base + min(r, extra) for r in range(world_size + 1)]
    return [range(starts[r], starts[r + 1]) for r in range(world_size)]


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
    policy,
    task: Task,
    *,
    num_prompts: int,
    group_size: int,
    seed: int,
    step: int,
    temperature: float,
    scale_by_std: bool = True,
    rank: int = 0,
    world_size: int = 1,
) -> Rollout:
    """Sample the global rollout batch of ``step``: a pure function of (seed, step, weights).

    ``policy`` is a ``gradnorm.trainer.policy.Policy``. ``world_size`` 1 samples every
    sequence here (replicated, or a single process); otherwise this rank samples the groups ``group_split(num_prompts, world_size)[rank]``, scores them, and one
    all_gather assembles the global batch on every rank (``world_size`` must then be the process
    group's size, and every rank must call this). Advantages are computed per group on the
    gathered rewards. Sampling goes through ``policy.model``, never the DDP wrapper (sampling is no
    part of the gradient and must not trigger DDP's hooks); under FSDP2 its parameters stay gathered
    for the whole generation, and every rank keeps decoding until all ranks have finished, because
    its forward is a collective.
    """
    model = policy.model
    device = next(model.parameters()).device
    G, P, R = group_size, task.prompt_len, task.max_new_tokens
    eos, pad = task.tokenizer.eos_id, task.tokenizer.pad_id
    prompts, answers = task.sample_prompts(num_prompts, seeded_generator(seed, "prompts", step))  # all of them: cheap
    split = group_split(num_prompts, world_size)
    mine = split[rank]
    rows = range(mine.start * G, mine.stop * G)  # global indices of the sequences this rank samples
    # A rank without a group still decodes one throwaway row (sequence 0 again), so that it joins
    # the lock-step and FSDP2's collectives like every other rank; its tokens are dropped below.
    sampled = rows if len(rows) else range(0, 1)
    local_prompts = prompts.repeat_interleave(G, dim=0)[sampled.start : sampled.stop].to(device)  # (S_r, P)
    lockstep = world_size > 1 and wrap.is_fsdp(model)
    was_training = model.training
    model.eval()
    with wrap.gathered_for_sampling(model) as sampler:
        tokens = policy.sample(
            sampler, local_prompts, R, eos, pad, temperature=temperature,
            uniforms=sequence_uniforms(sampled, R, seed, "sample", step),
            reduce=comm.all_reduce_sum if lockstep else None,
        )[: len(rows)]  # (S_r, P + R)
    model.train(was_training)
    local_answers = [answers[i // G] for i in rows]
    rewards = check_rewards(task.reward(tokens[:, P:].cpu(), local_answers), len(rows)).to(device)  # (S_r,)
    if world_size > 1:  # THE gather of the rollout: tokens (exact in float64) and rewards, one tensor
        most = max(len(r) for r in split) * G
        packed = torch.zeros(most, P + R + 1, dtype=torch.float64, device=device)  # padded to the largest share
        packed[: len(rows), : P + R] = tokens
        packed[: len(rows), -1] = rewards
        gathered = comm.all_gather(packed)  # (W, most, P + R + 1)
        if len(gathered) != world_size:
            raise ValueError(f"world_size={world_size} but the process group has {len(gathered)} rank(s)")
        full = torch.cat([gathered[r, : len(split[r]) * G] for r in range(world_size)])  # (S, P + R + 1)
        tokens, rewards = full[:, :-1].long(), full[:, -1].float()
    mask = response_mask(tokens[:, P:], eos)  # (S, R)
    width = max(int(mask.sum(-1).max()), 1)  # the longest response of the batch
    return Rollout(
        tokens=tokens[:, : P + width], mask=mask[:, :width], rewards=rewards,
        advantages=group_advantages(rewards, G, scale_by_std),
        group_ids=torch.arange(len(rewards), device=device) // G,
        group_size=G, prompt_len=P,
    )


@torch.no_grad()
def sampled_reward(policy, task: Task, num_prompts: int, temperature: float, seed: int) -> float:
    """Mean reward of one sampled response per prompt on a fixed prompt set (seeded by ``seed``).

    Replicated: every rank samples all ``num_prompts`` itself (a small batch, twice per run).
    """
    model = policy.model
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    prompts, answers = task.sample_prompts(num_prompts, seeded_generator(seed, "eval-prompts"))
    tokens = policy.sample(
        model, prompts.to(device), task.max_new_tokens, task.tokenizer.eos_id, task.tokenizer.pad_id,
        temperature=temperature, uniforms=sequence_uniforms(range(num_prompts), task.max_new_tokens, seed, "eval-sample"),
    )
    model.train(was_training)
    return float(task.reward(tokens[:, task.prompt_len :].cpu(), answers).mean())
