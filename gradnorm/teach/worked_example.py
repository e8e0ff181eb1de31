"""A worked example: how much each token weighs under every denominator, on two imbalanced ranks.

    python -m gradnorm.teach.worked_example

Two ranks, two microbatches each, two sequences per microbatch, two prompt groups of four
completions. Rank 0's first microbatch holds 1 + 2 = 3 response tokens; the other three hold 14,
12 and 12. Under ``local`` that short microbatch weighs as much as a full one, so each of its 3
tokens counts 14/3 times as much as a token of the next microbatch, and rank 0 takes a larger
share of the update than its share of the tokens. Every other mode gives the same weights
however the sequences are placed.
"""

from __future__ import annotations

from fractions import Fraction

import torch

from gradnorm.core.denominators import mask_from_lengths
from gradnorm.core.simulate import effective_weights

LENGTHS = torch.tensor([1, 2, 6, 8, 5, 7, 8, 4])  # sequence i has LENGTHS[i] response tokens
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])  # two prompts, four completions each
PLAN = [[torch.tensor([0, 1]), torch.tensor([2, 3])], [torch.tensor([4, 5]), torch.tensor([6, 7])]]  # [rank][mb]
MODES = ["local", "token", "sequence", "group", 48.0]


def main() -> None:
    mask = mask_from_lengths(LENGTHS)
    total = int(LENGTHS.sum())
    print(f"2 ranks x 2 microbatches; response tokens per microbatch: "
          f"{[[int(LENGTHS[mb].sum()) for mb in rank] for rank in PLAN]} (N = {total})\n")
    rank0_tokens = int(LENGTHS[torch.cat(PLAN[0])].sum())
    print("Weight of one token of each sequence in J, and rank 0's share of the update "
          f"(its share of the tokens: {rank0_tokens}/{total} = {rank0_tokens / total:.3f}).\n")
    header = f"{'mode':>9} | " + " | ".join(f"{f'seq {i} ({int(n)})':>9}" for i, n in enumerate(LENGTHS))
    print(header + " | rank 0 share")
    print("-" * (len(header) + 15))
    for mode in MODES:
        w = effective_weights(mask, GROUPS, 2, mode, PLAN)  # (S, T) weight of each token in J
        per_token = [Fraction(float(w[i, 0])).limit_denominator(10_000) for i in range(len(LENGTHS))]
        share = w[torch.cat(PLAN[0])].sum() / w.sum()
        name = mode if isinstance(mode, str) else f"C={mode:g}"
        print(f"{name:>9} | " + " | ".join(f"{str(x):>9}" for x in per_token) + f" | {float(share):.3f}")
    print("\nlocal: the 3 tokens of rank 0's first microbatch weigh 1/12 each, a token of the next one 1/56:"
          "\nthe short microbatch shouts, and every rank gets 1/W of the update whatever it holds."
          "\ntoken and C give rank 0 exactly its share of the tokens; sequence and group weigh whole"
          "\nsequences and groups equally by design, and give the same weights under any sharding.")


if __name__ == "__main__":
    main()
