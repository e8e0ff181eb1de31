"""Paired A/B of the decoding loop: finished rows dropped from the decode batch (issue 27) or kept.

    python benchmarks/decode_ab.py               # about a minute on 2 cores
    python benchmarks/decode_ab.py --rounds 4    # a smoke-sized run
    python benchmarks/decode_ab.py --drop-at 0   # B drops every finished row at once (sampling.DROP_AT)

The trainer's policy (``policy.build_policy``: TinyGPT, the default 2x64 and a wider 4x256, on the
built-in task) after its warm-up (``policy.warm_up``, so responses stop at ragged lengths as they
do in training), one process, one thread. Each round samples a new step's batch (32 prompts x 8
completions, up to 20 new tokens, per-sequence uniforms as ``rollout.generate_rollout`` draws them)
twice, with ``drop_finished`` True (B) and False (A), in an order that alternates every round so
that a noisy neighbour slows both alike; the two must give the same tokens. Printed: the median
seconds per batch of each, their ratio, and the rows the decode steps ran on (B over A), the
saving to expect where the matmuls dominate.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gradnorm.models import sampling
from gradnorm.models.tinygpt import TinyGPT, generate
from gradnorm.trainer.config import parse_config
from gradnorm.trainer.policy import build_policy, warm_up
from gradnorm.trainer.rollout import seeded_generator, sequence_uniforms

MODELS = {"2x64 (default)": [], "4x256": ["--n-layer", "4", "--n-embd", "256"]}


class CountRows(TinyGPT):
    """TinyGPT that adds up the rows of its decode steps (every forward after the prefill)."""

    rows = 0

    def forward(self, idx, kv_cache=None, **kwargs):
        if kv_cache is not None and kv_cache.pos > 0:
            self.rows += idx.shape[0]
        return super().forward(idx, kv_cache, **kwargs)


def measure(flags: list[str], rounds: int) -> dict:
    cfg = parse_config(flags)
    task, policy = build_policy(cfg, torch.device("cpu"))
    warm_up(policy.model, task, cfg)
    model = policy.model.eval()
    model.__class__ = CountRows  # the same module and weights, with a row counter
    G, R, eos, pad = cfg.group_size, task.max_new_tokens, task.tokenizer.eos_id, task.tokenizer.pad_id
    seconds, rows, lengths = {True: [], False: []}, {True: 0, False: 0}, []
    for step in range(1, rounds + 1):
        prompts, _ = task.sample_prompts(cfg.prompts_per_step, seeded_generator(cfg.seed, "prompts", step))
        prompts = prompts.repeat_interleave(G, dim=0)  # (S, P)
        uniforms = sequence_uniforms(range(len(prompts)), R, cfg.seed, "sample", step)
        tokens = {}
        for drop in ((True, False) if step % 2 else (False, True)):
            model.rows = 0
            start = time.perf_counter()
            tokens[drop] = generate(model, prompts, R, eos, pad, temperature=cfg.temperature, uniforms=uniforms,
                                    drop_finished=drop)
            seconds[drop].append(time.perf_counter() - start)
            rows[drop] += model.rows
        assert torch.equal(tokens[True], tokens[False]), f"step {step}: the two loops sampled different tokens"
        responses = tokens[True][:, task.prompt_len:]
        lengths.append(float(((responses == eos).cumsum(1) == 0).sum(1).add(1).clamp(max=R).float().mean()))
    return {"A": statistics.median(seconds[False]), "B": statistics.median(seconds[True]),
            "rows": rows[True] / rows[False], "length": statistics.mean(lengths), "S": len(prompts), "R": R}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="batches sampled by each loop, per model")
    parser.add_argument("--drop-at", type=float, default=sampling.DROP_AT,
                        help=f"the share of finished rows that leaves the batch (default {sampling.DROP_AT})")
    args = parser.parse_args()
    sampling.DROP_AT = args.drop_at
    torch.set_num_threads(1)
    print("| policy | batch | mean response | A: keep rows (s) | B: drop finished (s) | A / B | decode rows B / A |")
    print("|---|---|---|---|---|---|---|")
    for name, flags in MODELS.items():
        m = measure(flags, args.rounds)
        print(f"| {name} | {m['S']} x {m['R']} | {m['length']:.1f} tokens | {m['A']:.4f} | {m['B']:.4f} "
              f"| {m['A'] / m['B']:.2f}x | {m['rows']:.2f} |")
    print(f"\nmedian of {args.rounds} paired rounds, order alternated, DROP_AT = {args.drop_at:g}; "
          "identical tokens in every round")


if __name__ == "__main__":
    main()
