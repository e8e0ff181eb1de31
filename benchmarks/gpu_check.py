"""The GPU check: short NCCL trainings on one GPU, printed as a markdown table of tokens/s and memory.

    python benchmarks/gpu_check.py              # on a CUDA machine, a few minutes
    python benchmarks/gpu_check.py --nproc 8     # the same on 8 GPUs of one node
    python benchmarks/gpu_check.py --allow-cpu   # exercise the script itself on CPU (gloo, fp32)

Each row is one real launch of ``torchrun --standalone --nproc_per_node=N gradnorm/train.py``
(NCCL, bf16 autocast, no warm-up) for a few GRPO steps; its ``metrics.jsonl`` gives the numbers:

- tokens/s: response tokens of the global minibatch per second of a whole optimizer step
  (sampling with the KV cache, the forward and backward passes, the optimizer step), the median
  over the steps after the first (which pays for CUDA's warm-up);
- peak memory: ``torch.cuda.max_memory_allocated`` on rank 0 over the run, in GiB;
- rollout tokens/s per GPU (a second table, DDP rows): generation alone, timed by the worker of
  ``benchmarks/rollouts.py`` in one more launch per model: rank 0 sampling the whole batch alone
  (1 GPU), then all N ranks under ``--rollouts sharded`` (each samples its share, one all_gather)
  and ``replicated`` (each samples everything). Perfect scaling keeps sharded's tokens/s per GPU
  at the 1-GPU value; replicated's falls as 1/N.

Every model is built on the spot with random weights and the character-level tokenizer of the
offline tests (GPU machines are often offline): the built-in TinyGPT, the 2-layer width-32
Llama of the tests, and a ~280M-parameter Llama under DDP and under FSDP2 with gradient
checkpointing. Random models rarely emit EOS, so nearly every response runs to max-new-tokens.
A row's name gives the model's layers x width and parameter count.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from gradnorm.teach.launch import torchrun_command

ROOT = Path(__file__).resolve().parents[1]
# A ~280M-parameter Llama shape (24 layers, width 1024, 16 heads, GQA 16/8), char-level vocabulary:
# big enough that the GPU, not Python, sets the pace; small enough to build in seconds.
MEDIUM = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,
              num_key_value_heads=8)


def describe(model_dir: Path) -> str:
    """'Llama 24x1024 (283M params)': layers x width and the parameter count, read from the files."""
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    params = 0
    for shard in model_dir.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            params += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    size = f"{params / 1e6:.0f}M" if params >= 1e6 else f"{params / 1e3:.0f}k"
    return f"Llama {config['num_hidden_layers']}x{config['hidden_size']} ({size} params)"


def configurations(model_dir: Path) -> list[tuple[str, list[str]]]:
    """(row name, trainer flags) for every row of the table."""
    tiny, medium = model_dir / "tiny-llama", model_dir / "medium-llama"
    return [
        ("TinyGPT 2x64 (built-in task), DDP", ["--model", "tiny", "--max-new-tokens", "20"]),
        (f"{describe(tiny)}, DDP", ["--model", str(tiny)]),
        (f"{describe(medium)}, DDP", ["--model", str(medium)]),
        (f"{describe(medium)}, FSDP2 + gradient checkpointing",
         ["--model", str(medium), "--parallel", "fsdp", "--gradient-checkpointing"]),
    ]


def rollouts_benchmark():
    """benchmarks/rollouts.py as a module, loaded by path (scripts live outside the package)."""
    spec = importlib.util.spec_from_file_location("gradnorm_rollouts_benchmark", Path(__file__).with_name("rollouts.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rollout_rows(nproc: int, configs: list[tuple[str, list[str]]], device: str, rounds: int) -> list[str]:
    """Markdown rows: rollout tokens/s per GPU on 1 GPU and on ``nproc`` GPUs, both modes (DDP configs)."""
    bench, rows = rollouts_benchmark(), []
    batch = ["--prompts-per-step", "16", "--group-size", "8", "--max-new-tokens", "64", "--device", device]
    for name, flags in configs:
        if "fsdp" in flags:  # rank 0 cannot sample alone when the forward is a collective
            continue
        found = bench.measure(nproc, batch + flags, rounds)["configs"]

        def per_gpu(key, world):
            return f"{found[key]['tokens_per_s'] / world:,.0f}" if key in found else "n/a"

        rows.append(f"| {name} | {per_gpu('W=1 sharded', 1)} | {per_gpu(f'W={nproc} sharded', nproc)} | "
                    f"{per_gpu(f'W={nproc} replicated', nproc)} |")
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def launch(nproc: int, out: Path, flags: list[str], device: str, steps: int) -> list[dict]:
    """One torchrun launch of the trainer; returns its metrics rows."""
    cmd = torchrun_command(nproc, "--steps", str(steps), "--save-every", "0", "--warmup-steps", "0",
                           "--eval-prompts", "8", "--prompts-per-step", "16", "--group-size", "8",
                           "--max-new-tokens", "64", "--no-plot", "--device", device, "--output-dir", str(out),
                           "--overwrite", *flags)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summarize(rows: list[dict]) -> tuple[float, float | None]:
    """(median tokens/s over the steps after the first, peak GiB or None on CPU)."""
    timed = rows[1:] or rows
    peak = [r["max_memory_gib"] for r in rows if "max_memory_gib" in r]
    return statistics.median(r["tokens_per_second"] for r in timed), (max(peak) if peak else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=1, help="GPUs (ranks) per launch")
    parser.add_argument("--steps", type=int, default=6, help="GRPO steps per launch")
    parser.add_argument("--rollout-rounds", type=int, default=5, help="timed rollouts per configuration")
    parser.add_argument("--allow-cpu", action="store_true", help="run on CPU (gloo, fp32) to test this script")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}, CUDA build: {torch.version.cuda}); "
              "run it on a GPU machine (--allow-cpu exercises the script on CPU)", file=sys.stderr)
        return 1
    sys.path.insert(0, str(ROOT / "examples"))
    from tiny_models import build_tiny_llama  # needs transformers: pip install -e '.[hf]'

    device = "cuda" if cuda else "cpu"
    hardware = f"{args.nproc} x {torch.cuda.get_device_name(0)}, bf16 autocast" if cuda else f"CPU, {args.nproc} gloo rank(s), fp32"
    precision = ["--precision", "bf16"] if cuda else ["--precision", "fp32"]
    lines = [f"GPU check: {hardware}, torch {torch.__version__}, {args.steps} GRPO steps of 16 prompts x 8 "
             "completions, up to 64 new tokens", "",
             "| configuration | tokens/s | peak memory (GiB) |", "|---|---:|---:|"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        build_tiny_llama(tmp / "tiny-llama")
        # On CPU (--allow-cpu, a test of this script) the "medium" model stays small.
        build_tiny_llama(tmp / "medium-llama", **(MEDIUM if cuda else dict(hidden_size=64, num_hidden_layers=2)))
        for name, flags in configurations(tmp):
            rows = launch(args.nproc, tmp / f"run{len(lines)}", flags + precision, device, args.steps)
            tokens_per_s, peak = summarize(rows)
            lines.append(f"| {name} | {tokens_per_s:,.0f} | {'n/a' if peak is None else f'{peak:.2f}'} |")
            print(lines[-1], file=sys.stderr, flush=True)  # progress while the next row runs
        unit = "GPU" if cuda else "rank"
        lines += ["", f"Rollout generation alone (tokens/s per {unit}, median of {args.rollout_rounds} rounds):", "",
                  f"| configuration | 1 {unit} | {args.nproc} {unit}s, sharded | {args.nproc} {unit}s, replicated |",
                  "|---|---:|---:|---:|"]
        lines += rollout_rows(args.nproc, [(n, f + precision) for n, f in configurations(tmp)], device,
                              args.rollout_rounds)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
