"""Paired A/Bs of sampling: what each change to the decoding loop saves, and that none changes a token.

    python benchmarks/decode_ab.py                    # about 2 minutes on 2 cores (make bench runs it)
    python benchmarks/decode_ab.py --rounds 4 --out /tmp/ab   # a smoke-sized run
    python benchmarks/decode_ab.py --drop-at 0        # drop every finished row at once (sampling.DROP_AT)

Each A/B samples the same batch with a change off (A) and on (B), round after round, in an order
that alternates every round so that a noisy neighbour slows both alike, on one process and one
thread; the two must give the same tokens (asserted every round). A round is one step's rollout
batch as ``rollout.generate_rollout`` samples it: G completions per prompt, per-sequence uniforms.

- ``drop finished``: finished rows leave the decode batch (``sampling.decode``), against keeping
  every row to the end; TinyGPT after its warm-up (the default 2x64 and a wider 4x256), 32 prompts
  x 8 completions, up to 20 new tokens. The decode rows of B over A say what to expect where the
  matmuls dominate.
- ``prefill once per prompt``: a group's shared prompt prefilled once and copied to its G rows
  (``sampling.distinct_prompts``), against a prefill of every row; TinyGPT as above, and the tiny
  Qwen2 of ``benchmarks/vs_trl.py`` on its arithmetic prompts (16 prompts x 4, 32 new tokens).
- ``direct steps``: the tiny Qwen2's decoding steps by ``gradnorm.models.llama_decode``, against the
  model's own forward (``hf.generate(fast=False)``).

Writes ``decode_ab.md`` (the table, the command, the load) and ``decode_ab.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gradnorm.models import hf, sampling, tinygpt
from gradnorm.trainer.config import parse_config
from gradnorm.trainer.policy import build_policy
from gradnorm.trainer.warmup import warm_up
from gradnorm.trainer.rollout import seeded_generator, sequence_uniforms

ROOT = Path(__file__).resolve().parents[1]
TINYGPTS = {"TinyGPT 2x64 (default)": [], "TinyGPT 4x256": ["--n-layer", "4", "--n-embd", "256"]}


class CountRows(tinygpt.TinyGPT):
    """TinyGPT that adds up the rows of its decode steps (every forward after the prefill)."""

    rows = 0

    def forward(self, idx, kv_cache=None, **kwargs):
        if kv_cache is not None and kv_cache.pos > 0:
            self.rows += idx.shape[0]
        return super().forward(idx, kv_cache, **kwargs)


def prefilling_every_row(policy_module, sample: Callable) -> Callable:
    """``sample`` with ``distinct_prompts`` switched off in ``policy_module`` (``tinygpt`` or ``hf``):
    every row is prefilled, as before (A of the prefill A/B)."""

    def run(prompts, uniforms):
        policy_module.distinct_prompts = lambda p: (p, None)
        try:
            return sample(prompts, uniforms)
        finally:
            policy_module.distinct_prompts = sampling.distinct_prompts

    return run


def paired(rounds: int, batch: Callable[[int], tuple], a: Callable, b: Callable) -> dict:
    """Median seconds of ``a(*batch(round))`` and ``b(...)`` over alternating rounds; equal outputs asserted."""
    seconds: dict = {"A": [], "B": []}
    for r in range(1, rounds + 1):
        args = batch(r)
        out = {}
        for side in ("A", "B") if r % 2 else ("B", "A"):
            start = time.perf_counter()
            out[side] = (a if side == "A" else b)(*args)
            seconds[side].append(time.perf_counter() - start)
        assert torch.equal(out["A"], out["B"]), f"round {r}: A and B sampled different tokens"
    return {"A": statistics.median(seconds["A"]), "B": statistics.median(seconds["B"]), "rounds": rounds}


def tinygpt_rows(flags: list[str], rounds: int) -> list[dict]:
    cfg = parse_config(flags)
    task, policy = build_policy(cfg, torch.device("cpu"))
    warm_up(policy.model, task, cfg)  # responses then stop at ragged lengths, as in training
    model = policy.model.eval()
    model.__class__ = CountRows  # the same module and weights, with a row counter
    G, R, eos, pad = cfg.group_size, task.max_new_tokens, task.tokenizer.eos_id, task.tokenizer.pad_id

    def batch(step):
        prompts, _ = task.sample_prompts(cfg.prompts_per_step, seeded_generator(cfg.seed, "prompts", step))
        prompts = prompts.repeat_interleave(G, dim=0)  # (S, P)
        return prompts, sequence_uniforms(range(len(prompts)), R, cfg.seed, "sample", step)

    def sample(prompts, uniforms, drop=True):
        return tinygpt.generate(model, prompts, R, eos, pad, temperature=cfg.temperature, uniforms=uniforms,
                                drop_finished=drop)

    rows = {}
    for drop in (True, False):  # the decode rows of each loop, on the first batch
        model.rows = 0
        sample(*batch(1), drop=drop)
        rows[drop] = model.rows
    drop = paired(rounds, batch, lambda p, u: sample(p, u, drop=False), sample)

    prefill = paired(rounds, batch, prefilling_every_row(tinygpt, sample), sample)
    S = cfg.prompts_per_step * G
    shape = f"{cfg.prompts_per_step} x {G}, {R} new"
    return [{"change": "drop finished", "policy": flags_name(flags), "batch": shape, **drop,
             "note": f"decode rows B / A {rows[True] / rows[False]:.2f}"},
            {"change": "prefill once per prompt", "policy": flags_name(flags), "batch": shape, **prefill,
             "note": f"prefill rows {cfg.prompts_per_step} of {S}"}]


def flags_name(flags: list[str]) -> str:
    return next(name for name, f in TINYGPTS.items() if f == flags)


def qwen2_rows(rounds: int) -> list[dict]:
    sys.path.insert(0, str(ROOT / "examples"))
    from tiny_models import build_tiny_qwen2

    from gradnorm.tasks.prompts import PromptTask

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from vs_trl import GROUP, MAX_NEW, PROMPTS, PROMPTS_PER_STEP

    with tempfile.TemporaryDirectory(prefix="decode-ab-") as tmp:
        path = str(build_tiny_qwen2(Path(tmp) / "tiny-qwen2"))
        tok = hf.load_tokenizer(path)
        model = hf.load_causal_lm(path, tok.pad_token_id).eval()
    task = PromptTask.from_file(PROMPTS, tok, max_new_tokens=MAX_NEW)
    eos, pad = task.tokenizer.eos_id, task.tokenizer.pad_id

    def batch(step):
        prompts, _ = task.sample_prompts(PROMPTS_PER_STEP, seeded_generator(0, "prompts", step))
        prompts = prompts.repeat_interleave(GROUP, dim=0)
        return prompts, sequence_uniforms(range(len(prompts)), MAX_NEW, 0, "sample", step)

    def sample(prompts, uniforms, fast=True):
        return hf.generate(model, prompts, MAX_NEW, eos, pad, uniforms=uniforms, fast=fast)

    shape = f"{PROMPTS_PER_STEP} x {GROUP}, {MAX_NEW} new"
    name = f"tiny Qwen2 (prompts of {task.prompt_len} tokens)"
    return [{"change": "prefill once per prompt", "policy": name, "batch": shape,
             **paired(rounds, batch, prefilling_every_row(hf, sample), sample),
             "note": f"prefill rows {PROMPTS_PER_STEP} of {PROMPTS_PER_STEP * GROUP}"},
            {"change": "direct steps", "policy": name, "batch": shape,
             **paired(rounds, batch, lambda p, u: sample(p, u, fast=False), sample), "note": "llama_decode"}]


def render(rows: list[dict], args, load: tuple[float, float], seconds: float) -> str:
    lines = ["# Sampling A/Bs: each change to the decoding loop against the loop without it", "",
             f"Generated by `python benchmarks/decode_ab.py --rounds {args.rounds}` in {seconds:.0f} s on "
             f"{os.cpu_count()} CPUs ({platform.platform()}), torch {torch.__version__}, one process, one thread. "
             f"Load average {load[0]:.1f} before and {load[1]:.1f} after: the machine is shared, so the ratios, "
             "measured side by side, are worth more than the times.", "",
             f"Medians over {args.rounds} paired rounds (a new step's batch each round, the order of A and B "
             "alternating); A and B sampled identical tokens in every round (asserted). "
             f"`sampling.DROP_AT` = {args.drop_at:g}.", "",
             "| change | policy | batch | A: without (s) | B: with (s) | A / B | |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['change']} | {r['policy']} | {r['batch']} | {r['A']:.4f} | {r['B']:.4f} | "
                     f"{r['A'] / r['B']:.2f}x | {r['note']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="batches sampled by A and by B, per row")
    parser.add_argument("--drop-at", type=float, default=sampling.DROP_AT,
                        help=f"the share of finished rows that leaves the batch (default {sampling.DROP_AT})")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks", help="folder for decode_ab.md and .json")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    sampling.DROP_AT = args.drop_at
    torch.set_num_threads(1)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    rows = []
    for flags in TINYGPTS.values():
        rows += tinygpt_rows(flags, args.rounds)
        print(f"{rows[-1]['policy']}: done", flush=True)
    rows += qwen2_rows(args.rounds)
    seconds, load1 = time.perf_counter() - t0, os.getloadavg()[0]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_ab.json").write_text(json.dumps({"rounds": args.rounds, "load": [load0, load1],
                                                         "seconds": seconds, "rows": rows}, indent=1) + "\n")
    text = render(rows, args, (load0, load1), seconds)
    (args.out / "decode_ab.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
