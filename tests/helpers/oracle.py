"""The single-process full-batch oracle of the DDP and FSDP gradient tests, written out longhand.

INVARIANT are the modes whose gradient is the oracle's whatever the world size, accumulation and
sharding; MODES adds local; EMPTY is a minibatch with no response tokens at all.
"""

import torch

from gradnorm.core.sharding import make_plan
from gradnorm.teach.toy import DEFAULT_LENGTHS, make_policy, make_problem, token_losses

INVARIANT = ["token", "sequence", "group", 37.0]
MODES = INVARIANT + ["local"]
EMPTY = (0,) * len(DEFAULT_LENGTHS)


def oracle_objective(policy, problem, denominator, plan=None):
    """J over the whole minibatch in one process, written the way the papers write it."""
    mask = problem.mask
    l = torch.where(mask, token_losses(policy, problem, torch.arange(len(mask))).loss, 0.0)
    if denominator == "token":  # sum l / N
        return l.sum() / mask.sum()
    if denominator == "sequence":  # (1/S) sum_i (1/|o_i|) sum_t l
        per_sequence = [l[i].sum() / mask[i].sum() for i in range(len(mask)) if mask[i].any()]
        return sum(per_sequence) / len(per_sequence)
    if denominator == "group":  # (1/N_groups) sum_g (1/N_g) sum_{i in g} sum_t l
        per_group = []
        for g in range(problem.num_groups):
            members = problem.group_ids == g
            if mask[members].any():
                per_group.append(l[members].sum() / mask[members].sum())
        return sum(per_group) / len(per_group)
    if denominator == "local":  # (1/(W*A)) sum_{r,m} (1/N[r,m]) sum_{mb(r,m)} l
        world_size, accum_steps = len(plan), len(plan[0])
        total = sum(l[mb].sum() / mask[mb].sum() for rank in plan for mb in rank if mask[mb].any())
        return total / (world_size * accum_steps)
    return l.sum() / denominator  # a constant C


def flat(grads):
    return torch.cat([g.reshape(-1) for g in grads])


def oracle_gradient(case, world_size, dtype=torch.float64):
    policy = make_policy(0, dtype)
    problem = make_problem(lengths=case.lengths, dtype=dtype)
    plan = make_plan(case.shard, problem.lengths, world_size, case.accum_steps)
    params = list(policy.parameters())
    if not problem.mask.any():  # no tokens anywhere: J is the empty sum, 0, whatever the weights
        return torch.zeros_like(flat(params))
    return flat(torch.autograd.grad(oracle_objective(policy, problem, case.denominator, plan), params))
