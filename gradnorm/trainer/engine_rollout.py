"""--rollout-engine vllm: rollouts sampled by an in-process vLLM engine on every rank, synced every step.

The rule of ``gradnorm.trainer.rollout`` holds with vLLM's sampler in place of the built-in one:
the prompts of step k come from (seed, k), sequence i samples with the seed
``vllm_engine.sequence_seed(seed, k, i)`` as a request of its own, and rank r samples its share of
prompt groups (``group_split``); ONE all_gather of tokens, rewards and the engine's log-probs gives
every rank the global batch. The trainer scores log-probs itself, as it does for builtin rollouts.

After every optimizer step ``sync`` loads the policy's weights into the engine (in place, no
restart), so step k + 1 samples from the weights step k produced. ``mismatch`` compares the
engine's log-probs of the sampled tokens with the trainer's: a correct sync leaves only the
rounding of two implementations (fp32 here).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradnorm.core.grpo import group_advantages
from gradnorm.dist import comm
from gradnorm.models import vllm_engine
from gradnorm.trainer.guards.failures import InputError
from gradnorm.trainer.rollout import Rollout, check_rewards, group_split, response_mask, seeded_generator


class EngineRollouts:
    """One engine per rank for a Hugging Face policy; ``generate`` has generate_rollout's signature."""

    def __init__(self, cfg, task, policy):
        self.task, self.policy = task, policy
        self.engine = vllm_engine.VLLMEngine(cfg.model, max_model_len=task.block_size, seed=cfg.seed)
        self.sync(policy.model)  # the warm-up's or the checkpoint's weights, not the directory's
        self.engine_logp: Tensor | None = None

    def sync(self, model) -> None:
        self.engine.sync(model)

    @torch.no_grad()
    def generate(self, policy, task, *, num_prompts, group_size, seed, step, temperature, scale_by_std=True,
                 rank=0, world_size=1) -> Rollout:
        """The global rollout batch of ``step``; its engine log-probs (S, R) are kept in ``engine_logp``."""
        device = next(policy.model.parameters()).device
        G, P, R = group_size, task.prompt_len, task.max_new_tokens
        eos, pad = task.tokenizer.eos_id, task.tokenizer.pad_id
        prompts, answers = task.sample_prompts(num_prompts, seeded_generator(seed, "prompts", step))
        split = group_split(num_prompts, world_size)
        rows = range(split[rank].start * G, split[rank].stop * G)
        local = prompts.repeat_interleave(G, dim=0)[rows.start : rows.stop]  # (S_r, P), left-padded
        unpadded = [row[(row != pad).cumsum(0) > 0].tolist() for row in local]  # the engine takes no left pad
        out = self.engine.sample(unpadded, R, temperature=temperature, eos_id=eos, pad_id=pad,
                                 seeds=[vllm_engine.sequence_seed(seed, step, i) for i in rows])
        tokens = torch.cat([local, out.tokens], dim=1).to(device)  # (S_r, P + R)
        logp = out.logprobs.to(device)
        rewards = check_rewards(task.reward(out.tokens, [answers[i // G] for i in rows]), len(rows)).to(device)
        if world_size > 1:  # tokens (exact in float64), the engine's log-probs and rewards: one tensor
            most = max(len(r) for r in split) * G
            packed = torch.zeros(most, P + 2 * R + 1, dtype=torch.float64, device=device)
            packed[: len(rows), : P + R] = tokens
            packed[: len(rows), P + R : P + 2 * R] = logp
            packed[: len(rows), -1] = rewards
            gathered = comm.all_gather(packed)
            full = torch.cat([gathered[r, : len(split[r]) * G] for r in range(world_size)])
            tokens, logp, rewards = full[:, : P + R].long(), full[:, P + R : -1].float(), full[:, -1].float()
        mask = response_mask(tokens[:, P:], eos)
        width = max(int(mask.sum(-1).max()), 1)
        self.engine_logp = logp[:, :width]
        return Rollout(
            tokens=tokens[:, : P + width], mask=mask[:, :width], rewards=rewards,
            advantages=group_advantages(rewards, G, scale_by_std),
            group_ids=torch.arange(len(rewards), device=device) // G, group_size=G, prompt_len=P,
        )

    @torch.no_grad()
    def mismatch(self, rollout: Rollout, trainer_logp: Tensor | None = None) -> dict[str, float]:
        """Engine vs trainer log-probs over the response tokens of the last rollout (every rank alike).

        ``trainer_logp`` (S, R) defaults to scoring the whole batch with the policy's model.
        """
        model = self.policy.model
        if trainer_logp is None:
            was_training = model.training
            model.eval()
            trainer_logp = self.policy.score(model, rollout.tokens, rollout.prompt_len)[0]
            model.train(was_training)
        diff = (trainer_logp.float() - self.engine_logp)[rollout.mask]
        if diff.numel() == 0:
            return {}
        ratio = diff.exp()
        return {"engine_logp_absdiff_max": float(diff.abs().max()), "engine_logp_absdiff_mean": float(diff.abs().mean()),
                "engine_ratio_min": float(ratio.min()), "engine_ratio_max": float(ratio.max())}


def start(cfg, task, policy) -> EngineRollouts | None:
    """The engine of --rollout-engine vllm (an InputError if it cannot start), or None for builtin."""
    if cfg.rollout_engine != "vllm":
        return None
    try:
        return EngineRollouts(cfg, task, policy)
    except vllm_engine.EngineError as err:  # bad input, found once the model is built: exit code 2
        raise InputError(str(err)) from None
