"""One line of metrics.jsonl from a step's global statistics, and the step's skew: what ``local``
would have done to the same minibatch.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gradnorm.core.sharding import Plan, tokens_per_rank
from gradnorm.core.simulate import effective_weights
from gradnorm.trainer.chunks import forward_positions
from gradnorm.trainer.config import TrainConfig
from gradnorm.trainer.step import Minibatch, StepStats


def skew(batch: Minibatch, plan: Plan, cfg: TrainConfig) -> dict:
    """What the legacy per-microbatch mean would have done to this step's data, and the padding.

    From the plan and the lengths every rank already holds (no collective), the weights of
    ``local`` and of the run's mode (``token`` when the run is ``local`` itself) for every response
    token, as the simulation computes them:

        skew_max, skew_min   the largest and smallest w_local / w_mode over the tokens: how much
                             louder (or quieter) the old averaging makes a token than the run does
        rank_share_gap       max over ranks of |rank r's share of the update under local - its
                             share of the tokens N_r / N|: how far the old averaging moves the update
        mb_tokens_min, _max  the fewest and most response tokens of a microbatch, N[r, m]
        padding_fraction     positions the forward passes computed that hold no token (padding),
                             over all the positions they computed (idle passes not counted)
    """
    rows = batch.rollout
    lengths, mask, P = rows.lengths.cpu(), rows.mask.cpu(), rows.prompt_len
    group_ids = rows.group_ids.cpu()
    mode = "token" if cfg.denominator == "local" else cfg.denominator
    legacy = effective_weights(mask, group_ids, rows.num_groups, "local", plan)  # (S, R) float64
    fixed = effective_weights(mask, group_ids, rows.num_groups, mode, plan)
    kept = mask & (fixed > 0)
    ratio = legacy[kept] / fixed[kept]
    tokens = [[int(lengths[m].sum()) for m in rank] for rank in plan]
    N = max(sum(map(sum, tokens)), 1)
    gap = max(abs(float(legacy[rank_rows].sum()) - sum(rank_tokens) / N)
              for rank_rows, rank_tokens in ((torch.cat(r) if r else torch.zeros(0, dtype=torch.long), n)
                                             for r, n in zip(plan, tokens)))
    tokens_cpu = rows.tokens.cpu()
    left_pad = (torch.zeros(len(lengths), dtype=torch.long) if batch.pad_id is None
                else (torch.cumsum(tokens_cpu[:, :P] != batch.pad_id, dim=1) == 0).sum(1))  # (S,) padding of a prompt
    real = computed = 0
    for rank in plan:
        for rows in rank:
            real += int((lengths[rows] + P - left_pad[rows]).sum())
            computed += forward_positions(tokens_cpu[rows], lengths[rows], P, batch.pad_id, packed=cfg.pack)
    flat = [n for rank in tokens for n in rank]
    return {"skew_max": float(ratio.max()) if len(ratio) else 1.0, "skew_min": float(ratio.min()) if len(ratio) else 1.0,
            "rank_share_gap": gap, "mb_tokens_min": min(flat, default=0), "mb_tokens_max": max(flat, default=0),
            "padding_fraction": 1.0 - real / max(computed, 1)}


def record(step: int, stats: StepStats, grad_norm: Tensor, batch: Minibatch, plan: Plan, skipped: int,
           cfg: TrainConfig, with_skew: bool = True) -> dict:
    """One line of metrics.jsonl, before its timings: global statistics of the step (non-finite as
    null), and what the legacy mean would have done to it (``skew``; only where the line is written:
    rank 0, since every rank would compute the same numbers)."""
    rows = batch.rollout
    lengths = rows.lengths.cpu()
    values = {
        "step": step, "loss": stats.loss, "grad_norm": float(grad_norm),
        "reward_mean": float(rows.rewards.mean()), "exact_match": float((rows.rewards == 1.0).float().mean()),
        "response_len_mean": float(lengths.float().mean()), "response_len_max": int(lengths.max()),
        "tokens": stats.tokens, "tokens_per_rank": tokens_per_rank(plan, lengths),
        **{k: v for k, v in stats.logged().items() if k in ("pg_loss", "kl", "clipfrac", "entropy")},
        "rollout_digest": batch.rollout_digest, "skipped_steps": skipped, **(skew(batch, plan, cfg) if with_skew else {}),
    }
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in values.items()}
