"""Composite GRPO losses that name their terms, so ``gradnorm.audit`` weighs each term apart.

A loss may return a dict of scalar terms; the audit backpropagates each alone and reads its
weights (a term that does not scale with the advantages, an NLL or a KL, is read with slope 1, as
an SFT term's -log p is; ``gradnorm.audit.measurement``). Written from the published formulas:

    nll_term_per_microbatch    pg: 1 / N, right; nll: the microbatch's token mean, 1 / (W * n[r, m]),
                               with no division by A: A times too loud (the NLL term of NeMo-RL's
                               VAPO loss, measured at 32x under 32 microbatches, NeMo-RL PR #3791)
    every_term_over_global     pg, k3 KL and NLL each over the step's N: every term invariant (the control)

Each term's coefficient sets its size, not its invariance: a KL term weighs every token
``KL_COEF * (1 - exp(-0.1))`` times ``token`` at the audit's point (ref_logp = logp - 0.1).
"""

from __future__ import annotations

import torch

from gradnorm.core.grpo import clipped_surrogate

NLL_COEF, KL_COEF = 0.1, 0.05


def _pg(logp, old_logp, advantages, mask, num_tokens, world_size):
    loss, _ = clipped_surrogate(logp, old_logp, advantages)
    return torch.where(mask, loss, 0.0).sum() / num_tokens * world_size


def nll_term_per_microbatch(logp, old_logp, advantages, mask, *, num_tokens, world_size):
    """{pg: the fix, nll: NLL_COEF x the microbatch's own token mean of -log p (no 1/A, no global count)}."""
    nll = torch.where(mask, -logp, 0.0).sum() / mask.sum().clamp(min=1)
    return {"pg": _pg(logp, old_logp, advantages, mask, num_tokens, world_size), "nll": NLL_COEF * nll}


def every_term_over_global(logp, old_logp, advantages, mask, *, ref_logp, num_tokens, world_size):
    """{pg, kl, nll}, each a token sum over the step's N, times W: every term weighs 1/N (times its coefficient)."""
    log_ratio = ref_logp - logp
    kl = torch.where(mask, torch.exp(log_ratio) - log_ratio - 1, 0.0).sum()  # k3
    nll = torch.where(mask, -logp, 0.0).sum()
    return {"pg": _pg(logp, old_logp, advantages, mask, num_tokens, world_size),
            "kl": KL_COEF * kl / num_tokens * world_size, "nll": NLL_COEF * nll / num_tokens * world_size}


CATALOGUE = {fn.__name__: fn for fn in (nll_term_per_microbatch, every_term_over_global)}
"""Every convention above by name, in the order of the module docstring."""

FLAGS = {name: ("--world-size", "2", "--accum-steps", "32") for name in CATALOGUE}
"""The flags each convention is audited with: A = 32, the microbatch count of the measured case."""
