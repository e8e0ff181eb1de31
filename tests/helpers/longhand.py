"""Loss weights written out longhand, the oracle of tests/unit/core/test_oracle.py and tests/distributed/test_trainer_step.py.

Loops over plain integers, one branch per mode, the way the papers define them; nothing from
gradnorm. Every token of sequence i gets the same weight w_i in J = sum_i w_i sum_t l[i, t] M[i, t]:

    token      1 / N                   N: response tokens of the whole batch
    sequence   1 / (S_tok * |o_i|)     S_tok: sequences with at least one token
    group      1 / (N_groups * N_g(i))       N_g: tokens of prompt group g; N_groups: groups with a token
    C          1 / C                   a constant (Dr GRPO: C = S * max_new_tokens, S every sequence)
    local      1 / (W * A_r * N[r, m]) N[r, m]: tokens of the microbatch that holds sequence i;
                                       A_r: microbatches of its rank (a token budget makes them differ)

A sequence with no tokens has nothing to weight; it gets 0.
"""


def longhand_weights(denominator, lengths: list[int], groups: list[int], plan) -> list[float]:
    """w_i for every sequence i, from the response lengths |o_i|, the groups and (for local) the plan."""
    n = len(lengths)
    if denominator == "token":
        total = sum(lengths)
        return [1.0 / total if length else 0.0 for length in lengths]
    if denominator == "sequence":
        with_a_token = sum(1 for length in lengths if length > 0)
        return [1.0 / (with_a_token * length) if length else 0.0 for length in lengths]
    if denominator == "group":
        group_tokens = {}
        for length, g in zip(lengths, groups):
            group_tokens[g] = group_tokens.get(g, 0) + length
        active = sum(1 for tokens in group_tokens.values() if tokens > 0)
        return [1.0 / (active * group_tokens[g]) if length else 0.0 for length, g in zip(lengths, groups)]
    if denominator == "local":
        world_size = len(plan)
        weights = [0.0] * n
        for rank in plan:
            accum_steps = len(rank)
            for mb in rank:
                members = [int(i) for i in mb]
                mb_tokens = sum(lengths[i] for i in members)
                for i in members:
                    weights[i] = 1.0 / (world_size * accum_steps * mb_tokens) if lengths[i] else 0.0
        return weights
    return [1.0 / denominator if length else 0.0 for length in lengths]  # a constant C
