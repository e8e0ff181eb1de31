"""--rollout-engine vllm: rollouts sampled by an in-process vLLM engine on every rank, synced every step.

The rule of ``gradnorm.trainer.rollout`` holds with vLLM's sampler in place of the built-in one:
the prompts of step k come from (seed, k), sequence i samples with the seed
``vllm_engine.sequence_seed(seed, k, i)`` as a request of its own, and rank r samples its share of
prompt groups (``group_split``); ONE all_gather of tokens, rewards and the engine's log-probs gives
every rank the global batch. The trainer scores log-probs itself, as it does for builtin rollouts.

After every optimizer step ``sync`` loads the policy's weights into the engine (in place, no
restart), so step k + 1 samples from the weights step k produced. ``check`` compares the
engine's log-probs of the sampled tokens with the trainer's own scores of them (a correct sync
leaves only the rounding of two implementations, fp32 here) and derives the
--engine-correction of the batch from them (``gradnorm.core.importance``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradnorm.core import importance
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

    def check(self, rollout: Rollout, trainer_logp: Tensor, rows: Tensor, kind: str = "none",
              cap: float = 2.0) -> tuple[importance.EngineCorrection, dict[str, float]]:
        """``check`` of the last rollout batch against the log-probs this engine sampled it with."""
        return check(rollout, trainer_logp, self.engine_logp, rows, kind, cap)


@torch.no_grad()
def check(rollout: Rollout, trainer_logp: Tensor, engine_logp: Tensor, rows: Tensor, kind: str = "none",
          cap: float = 2.0) -> tuple[importance.EngineCorrection, dict[str, float]]:
    """The engine correction of a rollout batch, and how far the engine is from the trainer.

    ``trainer_logp`` (S, R): the trainer's own log-probs of the sampled tokens (the sampling
    policy's, ``scoring.score``), filled on ``rows``, the rows this rank trains on; ``engine_logp``
    (S, R) the engine's. The ranks' rows partition the batch, so the statistics over every
    response token take two small all-reduces (a max and a sum), and each rank looks at about S / W
    rows. The correction covers this rank's rows (its response mask is False elsewhere).
    """
    device = rollout.mask.device
    mask = torch.zeros_like(rollout.mask)
    mask[rows.to(device)] = rollout.mask[rows.to(device)]  # this rank's response tokens
    correction = importance.correct(trainer_logp, engine_logp, mask, kind, cap)
    diff = (trainer_logp.double() - engine_logp.double())[mask]
    ratio = diff.exp()
    most = (torch.stack([diff.abs().max(), ratio.max(), -ratio.min()]) if diff.numel()
            else torch.full((3,), -torch.inf, dtype=torch.float64, device=device))
    most = comm.all_reduce_max(most)
    sums = comm.all_reduce_sum(torch.stack([diff.abs().sum(), torch.tensor(float(diff.numel()), device=device),
                                            correction.capped.sum().double(), correction.dropped.sum().double()]))
    if sums[1] == 0:
        return correction, {}
    fields = {"engine_logp_absdiff_max": float(most[0]), "engine_logp_absdiff_mean": float(sums[0] / sums[1]),
              "engine_ratio_min": float(-most[2]), "engine_ratio_max": float(most[1])}
    if kind == "truncate":
        fields["engine_capped_tokens"] = int(sums[2])
    if kind == "mask":
        fields["engine_dropped_tokens"] = int(sums[3])
    return correction, fields


def minibatch_fields(correction: importance.EngineCorrection, span: slice) -> dict:
    """The ``step.Minibatch`` fields of the correction for the rollout's rows ``span``: the tokens the
    loss keeps when it drops some (mask), the surrogate's factor when it caps (truncate)."""
    return {"kept": correction.kept[span] if correction.dropped.any() else None,
            "importance_weight": None if correction.weight is None else correction.weight[span]}


def start(cfg, task, policy) -> EngineRollouts | None:
    """The engine of --rollout-engine vllm (an InputError if it cannot start), or None for builtin."""
    if cfg.rollout_engine != "vllm":
        return None
    try:
        return EngineRollouts(cfg, task, policy)
    except vllm_engine.EngineError as err:  # bad input, found once the model is built: exit code 2
        raise InputError(str(err)) from None
