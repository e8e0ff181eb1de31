"""A race against TRL: GRPOTrainer and gradnorm on the same tiny Qwen2, the same prompts, the same batch.

    pip install -e '.[hf,bench]'              # TRL, pinned (trl==1.16.0); never a library dependency
    python benchmarks/vs_trl.py               # 5 rounds, about 12 minutes (make bench runs this); writes benchmarks/vs_trl.md
    python benchmarks/vs_trl.py --quick       # 1 round of fewer steps: a smoke test

Both sides train ``examples/tiny_models.py``'s ``build_tiny_qwen2`` (a random 2-layer, width-32 Qwen2 with a
character tokenizer, built offline) on ``examples/arithmetic.jsonl`` through the tokenizer's chat
template: 16 prompts x 4 completions = 64 sequences per optimizer step whatever W, at most 32
new tokens, temperature 1, fp32 on CPU, one thread per process, DAPO's token-level loss, clip
0.2 / 0.28, no KL, no reference model, AdamW at a constant lr of 1e-5, gradient clipping at 1,
no checkpoints or evaluation inside the timed steps. Each launch is its own ``torchrun
--nproc_per_node=W`` (TRL through accelerate's torchrun support), W = 1 and W = 2; a round runs
the four launches back to back in an order that alternates from round to round, so a noisy
neighbour hits both sides alike. The first ``--skip`` steps of each launch are warm-up and not
counted. Reported per optimizer step: wall time, rollout time (sampling, reward, advantages) and
response tokens per second of the global batch; and each ratio TRL / gradnorm.

Known differences of the work done, which the results state too. Both sides sample only each
rank's share of the batch. TRL samples with ``model.generate``, every decoding step through the
model's forward, and prefills each prompt once per completion. gradnorm samples with its own seeded
loop: each distinct prompt is prefilled once (``sampling.distinct_prompts``), finished rows leave
the decode batch, and the Qwen2's decoding steps run directly on its parameters
(``gradnorm.models.llama_decode``, the model's logits bit for bit); ``benchmarks/decode_ab.md``
times each of those alone. TRL's training forward computes every completion's prompt; gradnorm's
computes each distinct prompt once and the completions against copies of its KV cache (the same
log-probs to fp32 rounding; ``benchmarks/forward_ab.md`` times it alone). TRL gathers its logged metrics across ranks every step; gradnorm
all-reduces one vector of sums (and one of phase times).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gradnorm.teach.launch import torchrun_command

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "examples" / "arithmetic.jsonl"
PROMPTS_PER_STEP, GROUP, MAX_NEW, LR = 16, 4, 32, 1e-5
TRL_PIN = "trl==1.16.0"


# ------------------------------------------------------------------ the TRL side (one torchrun worker)


def trl_worker(model_dir: str, steps: int, out: str) -> None:
    """Train with GRPOTrainer for ``steps`` steps; rank 0 writes one JSON record per step to ``out``."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from gradnorm.tasks.prompts import load_prompts
    from gradnorm.tasks.rewards import exact_match_math

    torch.set_num_threads(1)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    examples = load_prompts(PROMPTS)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": e.prompt}], "answer": e.answer} for e in examples])

    def reward(completions, answer, **_):
        return [exact_match_math(c[0]["content"], a) for c, a in zip(completions, answer)]

    config = GRPOConfig(**TRL_SETTINGS, per_device_train_batch_size=PROMPTS_PER_STEP * GROUP // world_size,
                        max_steps=steps, output_dir=tempfile.mkdtemp(prefix="trl-"))
    records: list[dict] = []

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            batch = super()._generate_and_score_completions(inputs)
            tokens = self.accelerator.reduce(batch["completion_mask"].sum().float(), reduction="sum")
            records.append({"rollout_s": time.perf_counter() - start, "tokens": int(tokens)})
            return batch

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            records[-1]["step_s"] = time.perf_counter() - self.start

    trainer = Timed(model=model_dir, reward_funcs=reward, args=config, train_dataset=data, callbacks=[StepClock()])
    trainer.train()
    if trainer.accelerator.is_main_process:
        Path(out).write_text(json.dumps(records))


TRL_SETTINGS = dict(
    num_generations=GROUP, max_completion_length=MAX_NEW, loss_type="dapo", beta=0.0, num_iterations=1,
    gradient_accumulation_steps=1, epsilon=0.2, epsilon_high=0.28, scale_rewards="group", temperature=1.0,
    top_p=1.0, top_k=0, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
    max_grad_norm=1.0, optim="adamw_torch", use_vllm=False, gradient_checkpointing=False, bf16=False,
    fp16=False, use_cpu=True, report_to="none", logging_steps=1, disable_tqdm=True, save_strategy="no",
    eval_strategy="no", log_completions=False, seed=0, dataloader_num_workers=0, ddp_find_unused_parameters=False,
    model_init_kwargs={"dtype": "float32"},
)
"""Every GRPOConfig setting the race sets (the rest are TRL 1.16.0's defaults); results.md prints them."""

GRADNORM_FLAGS = ["--prompts", str(PROMPTS), "--prompts-per-step", str(PROMPTS_PER_STEP), "--group-size", str(GROUP),
                  "--max-new-tokens", str(MAX_NEW), "--loss-denominator", "token", "--lr", str(LR),
                  "--clip-low", "0.2", "--clip-high", "0.28", "--beta", "0", "--max-grad-norm", "1.0",
                  "--precision", "fp32", "--device", "cpu", "--cpu-threads", "1", "--save-every", "0",
                  "--eval-prompts", "4", "--no-plot", "--seed", "0"]
"""Every gradnorm flag the race sets besides --model, --steps and --output-dir."""


# ------------------------------------------------------------------ the driver


def _torchrun(world_size: int, script: str, *args: str) -> list[str]:
    return torchrun_command(world_size, *args, script=script)


def run_gradnorm(model_dir: Path, world_size: int, steps: int, work: Path) -> list[dict]:
    out = work / f"gradnorm-w{world_size}"
    _run(_torchrun(world_size, "gradnorm/train.py", "--model", str(model_dir), "--steps", str(steps),
                   "--output-dir", str(out), "--overwrite", *GRADNORM_FLAGS))  # each round replaces the last
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    previous = [0.0] + [r["elapsed_s"] for r in rows]
    return [{"step_s": r["elapsed_s"] - p, "rollout_s": r["time_rollout_s"], "tokens": r["tokens"]}
            for r, p in zip(rows, previous)]


def run_trl(model_dir: Path, world_size: int, steps: int, work: Path) -> list[dict]:
    out = work / f"trl-w{world_size}.json"
    _run(_torchrun(world_size, str(Path(__file__).resolve()), "--trl-worker", str(model_dir), "--steps", str(steps),
                   "--records", str(out)))
    return json.loads(out.read_text())


def _run(cmd: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def race(rounds: int, steps: int, skip: int) -> dict:
    """{W: {side: [per-step records of every round, warm-up steps dropped]}}."""
    sys.path.insert(0, str(ROOT / "examples"))
    from tiny_models import build_tiny_qwen2

    runners = {"trl": run_trl, "gradnorm": run_gradnorm}
    found: dict = {w: {side: [] for side in runners} for w in (1, 2)}
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp:
        work = Path(tmp)
        model_dir = build_tiny_qwen2(work / "tiny-qwen2")
        for r in range(rounds):
            for w in (1, 2):
                order = ["trl", "gradnorm"] if (r + w) % 2 else ["gradnorm", "trl"]
                for side in order:
                    print(f"round {r + 1}/{rounds}, W={w}: {side}", flush=True)
                    found[w][side] += [{**rec, "round": r} for rec in runners[side](model_dir, w, steps, work)[skip:]]
    return found


def summarize(found: dict) -> dict:
    """Medians per side and W, and the ratios TRL / gradnorm."""
    table = {}
    for w, sides in found.items():
        med = {side: {"step_s": statistics.median(r["step_s"] for r in rows),
                      "rollout_s": statistics.median(r["rollout_s"] for r in rows),
                      "tokens_per_s": statistics.median(r["tokens"] / r["step_s"] for r in rows),
                      "tokens": statistics.median(r["tokens"] for r in rows), "n": len(rows)}
               for side, rows in sides.items()}
        ratio = {k: med["trl"][k] / med["gradnorm"][k] for k in ("step_s", "rollout_s", "tokens_per_s")}
        # gradnorm's step over TRL's, round by round (the two sides of a round ran back to back)
        rounds = sorted({r["round"] for r in sides["trl"]})
        per_round = [statistics.median(r["step_s"] for r in sides["gradnorm"] if r["round"] == k)
                     / statistics.median(r["step_s"] for r in sides["trl"] if r["round"] == k) for k in rounds]
        table[w] = {**med, "trl_over_gradnorm": ratio, "gradnorm_over_trl_step_by_round": per_round}
    return table


def render(table: dict, meta: dict) -> str:
    import trl

    lines = ["# gradnorm against TRL's GRPOTrainer", "",
             f"Generated by `make bench` (`python benchmarks/vs_trl.py{' --quick' if meta['quick'] else ''}`): "
             f"{meta['rounds']} round(s) x {meta['steps']} steps per launch, the first {meta['skip']} of each "
             f"dropped, TRL {trl.__version__}, {os.cpu_count()} CPUs, load average {meta['load']:.1f} at the start."
             + (" A --quick run: smoke-sized, it checks the command; quote only a full run on a quiet machine."
                if meta["quick"] else ""),
             "", "Medians per optimizer step of 16 prompts x 4 completions (64 sequences, <= 32 new tokens):", "",
             "| W | side | step (s) | rollout (s) | response tokens / s | tokens per step | steps |",
             "|---|---|---|---|---|---|---|"]
    for w, row in table.items():
        for side in ("trl", "gradnorm"):
            m = row[side]
            lines.append(f"| {w} | {side} | {m['step_s']:.3f} | {m['rollout_s']:.3f} | {m['tokens_per_s']:.0f} |"
                         f" {m['tokens']:.0f} | {m['n']} |")
    lines += ["", "| W | gradnorm's step / TRL's | the same, round by round | TRL / gradnorm: step time | rollout time "
              "| tokens / s |", "|---|---|---|---|---|---|"]
    for w, row in table.items():
        r = row["trl_over_gradnorm"]
        by_round = ", ".join(f"{x:.2f}" for x in row.get("gradnorm_over_trl_step_by_round", []))
        lines.append(f"| {w} | {1 / r['step_s']:.2f} | {by_round} | {r['step_s']:.2f} | {r['rollout_s']:.2f} "
                     f"| {r['tokens_per_s']:.2f} |")
    lines += ["", "Rollout: TRL's `_generate_and_score_completions` (prompt tokenization, `model.generate`, decoding,"
              " reward, advantages, gathers); gradnorm's `time_rollout_s` (its seeded sampling loop, reward,"
              " advantages, the all_gather of the sharded batch). Both sample only each rank's share of the"
              " batch (gradnorm's default `--rollouts sharded`).", "",
              "Training forward: TRL's runs every completion's prompt; gradnorm's runs each distinct prompt once and"
              " the completions against copies of its KV cache (the same log-probs to fp32 rounding;"
              " `benchmarks/forward_ab.md` times the two alone).", "",
              "TRL's `GRPOConfig` (everything else at TRL's defaults; `per_device_train_batch_size` = 64 / W):", "",
              "```", *(f"{k}={v!r}" for k, v in TRL_SETTINGS.items()), "```", "",
              "gradnorm's flags (besides `--model`, `--steps`, `--output-dir`):", "",
              "```", " ".join(GRADNORM_FLAGS).replace(str(ROOT) + "/", ""), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 round of 4 steps: a smoke test")
    parser.add_argument("--rounds", type=int, help="rounds of the four launches (default 5: the rounds scatter; quick 1)")
    parser.add_argument("--steps", type=int, help="optimizer steps per launch (default 12; quick 4)")
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps dropped from each launch")
    parser.add_argument("--out", default="benchmarks", help="folder for vs_trl.md and vs_trl.json")
    parser.add_argument("--trl-worker", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--records", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        import trl  # noqa: F401
    except ImportError:
        print(f"vs_trl: skipped, TRL is not installed (pip install -e '.[hf,bench]' installs {TRL_PIN})")
        return 0
    if args.trl_worker:
        trl_worker(args.trl_worker, args.steps, args.records)
        return 0
    meta = {"quick": args.quick, "rounds": args.rounds or (1 if args.quick else 5),
            "steps": args.steps or (4 if args.quick else 12), "skip": args.skip, "load": os.getloadavg()[0]}
    table = summarize(race(meta["rounds"], meta["steps"], meta["skip"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vs_trl.json").write_text(json.dumps({"meta": meta, "table": table}, indent=2))
    (out / "vs_trl.md").write_text(render(table, meta))
    print((out / "vs_trl.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
