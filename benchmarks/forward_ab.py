"""Paired A/B of the training forward: each distinct prompt once, against every row's prompt.

    python benchmarks/forward_ab.py                      # under a minute on 2 cores (make bench runs it)
    python benchmarks/forward_ab.py --rounds 4 --out /tmp/ab   # a smoke-sized run

A group's G completions share their prompt. ``hf.response_logprobs(..., share_prompts=True)`` runs
the distinct prompts once and the responses against copies of their KV cache (B); the one-call
forward runs every row's prompt again (A). Both are timed as the trainer runs them: one step's
rollout batch of the race in ``benchmarks/vs_trl.py`` (its tiny Qwen2, 16 arithmetic prompts x 4
completions, up to 32 new tokens, sampled by ``hf.generate``), scored in the trainer's
length chunks (``score_by_length``), on one process and one thread. Two rows:

- ``forward + backward``: the training forward of a whole minibatch and the backward of a loss
  that reads every response position (what the trainer's ``forward_backward`` phase does);
- ``scoring``: the same forward under ``torch.no_grad`` (the sampling policy's and reference's
  log-probs under rollout reuse or ``--beta`` > 0).

A and B alternate order every round, so a noisy neighbour slows both alike; each round asserts
that B's log-probs (and, for the backward, the parameter gradients) equal A's to fp32 rounding.
Writes ``forward_ab.md`` and ``forward_ab.json`` to ``--out``.
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
from pathlib import Path

import torch
from torch.testing import assert_close

from gradnorm.models import hf
from gradnorm.trainer.chunks import score_by_length
from gradnorm.trainer.rollout import response_mask, seeded_generator, sequence_uniforms

ROOT = Path(__file__).resolve().parents[1]


def race_model_and_batches(rounds: int):
    """The race's tiny Qwen2 (training mode) and one sampled rollout batch per round: (tokens, P, lengths)."""
    sys.path.insert(0, str(ROOT / "examples"))
    from tiny_models import build_tiny_qwen2

    from gradnorm.tasks.prompts import PromptTask

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from vs_trl import GROUP, MAX_NEW, PROMPTS, PROMPTS_PER_STEP

    with tempfile.TemporaryDirectory(prefix="forward-ab-") as tmp:
        path = str(build_tiny_qwen2(Path(tmp) / "tiny-qwen2"))
        tok = hf.load_tokenizer(path)
        model = hf.load_causal_lm(path, tok.pad_token_id)
    task = PromptTask.from_file(PROMPTS, tok, max_new_tokens=MAX_NEW)
    eos, pad = task.tokenizer.eos_id, task.tokenizer.pad_id
    batches = []
    for step in range(1, rounds + 1):
        prompts, _ = task.sample_prompts(PROMPTS_PER_STEP, seeded_generator(0, "prompts", step))
        prompts = prompts.repeat_interleave(GROUP, dim=0)
        uniforms = sequence_uniforms(range(len(prompts)), MAX_NEW, 0, "sample", step)
        tokens = hf.generate(model.eval(), prompts, MAX_NEW, eos, pad, uniforms=uniforms)
        lengths = response_mask(tokens[:, task.prompt_len:], eos).sum(1)  # |o_i|, as the trainer counts them
        batches.append((tokens, task.prompt_len, lengths))
    return model.train(), f"tiny Qwen2, {PROMPTS_PER_STEP} prompts x {GROUP}, <= {MAX_NEW} new", batches


def scorer(model, share: bool):
    pad, keep = model.config.pad_token_id, hf.accepts_logits_to_keep(model)
    return lambda m, tokens, P: hf.response_logprobs(m, tokens, P, pad_id=pad, keep_logits=keep, share_prompts=share)


def forward_backward(model, share: bool):
    def run(tokens, P, lengths):
        model.zero_grad(set_to_none=True)
        logp, entropy = score_by_length(scorer(model, share), model, tokens, P, lengths)
        mask = torch.arange(logp.shape[1]) < lengths[:, None]
        (-(logp * mask).sum() / mask.sum()).backward()
        return logp.detach(), torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return run


def scoring(model, share: bool):
    def run(tokens, P, lengths):
        with torch.no_grad():
            return (score_by_length(scorer(model, share), model, tokens, P, lengths)[0],)
    return run


def paired(batches, a, b) -> dict:
    """Median seconds of a(*batch) and b(*batch) over alternating rounds; equal outputs to fp32 rounding asserted."""
    seconds: dict = {"A": [], "B": []}
    for r, batch in enumerate(batches, start=1):
        out = {}
        for side in ("A", "B") if r % 2 else ("B", "A"):
            start = time.perf_counter()
            out[side] = (a if side == "A" else b)(*batch)
            seconds[side].append(time.perf_counter() - start)
        for got, want in zip(out["B"], out["A"]):
            assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"round {r}: B differs from A: {m}")
    return {"A": statistics.median(seconds["A"]), "B": statistics.median(seconds["B"]), "rounds": len(batches)}


def render(rows: list[dict], args, load: tuple[float, float], seconds: float) -> str:
    lines = ["# Training-forward A/B: each distinct prompt once, against every row's prompt", "",
             f"Generated by `python benchmarks/forward_ab.py --rounds {args.rounds}` in {seconds:.0f} s on "
             f"{os.cpu_count()} CPUs ({platform.platform()}), torch {torch.__version__}, one process, one thread. "
             f"Load average {load[0]:.1f} before and {load[1]:.1f} after: the machine is shared, so the ratios, "
             "measured side by side, are worth more than the times.", "",
             f"Medians over {args.rounds} paired rounds (a new step's rollout batch each round, the order of A "
             "and B alternating); B's log-probs, and after the backward its gradients, equal A's to fp32 "
             "rounding in every round (asserted, rtol 1e-5).", "",
             "| forward | model and batch | A: every row's prompt (s) | B: each prompt once (s) | A / B |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['forward']} | {r['batch']} | {r['A']:.4f} | {r['B']:.4f} | {r['A'] / r['B']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="rollout batches timed by A and by B, per row")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks", help="folder for forward_ab.md and .json")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    torch.set_num_threads(1)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    model, batch_name, batches = race_model_and_batches(args.rounds)
    rows = [{"forward": "forward + backward", "batch": batch_name,
             **paired(batches, forward_backward(model, False), forward_backward(model, True))},
            {"forward": "scoring (no grad)", "batch": batch_name,
             **paired(batches, scoring(model, False), scoring(model, True))}]
    seconds, load1 = time.perf_counter() - t0, os.getloadavg()[0]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "forward_ab.json").write_text(json.dumps({"rounds": args.rounds, "load": [load0, load1],
                                                          "seconds": seconds, "rows": rows}, indent=1) + "\n")
    text = render(rows, args, (load0, load1), seconds)
    (args.out / "forward_ab.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
