"""The built-in model's supervised warm-up on the task's demonstrations (departure 1 of
``gradnorm/train.py``): replicated on every rank, so the starting policy is independent of W.
"""

from __future__ import annotations

import torch

from gradnorm.models.tinygpt import TinyGPT, token_logprobs_and_entropy
from gradnorm.tasks import RepeatTask
from gradnorm.trainer.config import TrainConfig
from gradnorm.trainer.rollout import seeded_generator


def warm_up(model: TinyGPT, task: RepeatTask, cfg: TrainConfig) -> None:
    """Next-token training on demonstrations (masked token-mean NLL), run identically on every rank.

    No DDP and no collectives: every rank computes the same full batch bit for bit, so the policy
    GRPO starts from is the same for every W.
    """
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warmup_lr, weight_decay=0.0)
    g = seeded_generator(cfg.seed, "warmup")
    for _ in range(cfg.warmup_steps):
        tokens, loss_mask = (t.to(device) for t in task.demonstrations(cfg.warmup_batch, g))
        logp, _ = token_logprobs_and_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        mask = loss_mask[:, 1:]
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
