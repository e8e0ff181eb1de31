"""The rollout phase with vLLM's CPU build against the built-in Hugging Face decode, side by side.

    make bench-vllm                                   # in the vLLM environment (make test-vllm builds it)
    .venv-vllm/bin/python benchmarks/rollout_engines.py --rounds 2 --out /tmp/re   # a smoke-sized run

For each model, one step's rollout batch as the trainer samples it (``--rollout-engine builtin``:
``rollout.generate_rollout``; ``--rollout-engine vllm``: ``engine_rollout.EngineRollouts.generate``),
the two engines alternating round after round so that a noisy neighbour slows both alike, on one
process and one thread (what each of the trainer's ranks runs with OMP_NUM_THREADS=1):

- the tiny Qwen2 of the vLLM tests (2 layers x 128, head_dim 64), 4 prompts x 4, 32 new tokens;
- a Qwen2 where the matmuls dominate (4 layers x 256, head_dim 64), 4 prompts x 4, 128 new tokens.

Each row gives the median seconds of a batch, the ratio, the response tokens per second, and each
engine's achieved FLOP/s as a share of this CPU's measured fp32 matmul peak on one thread (the
limit no decode loop beats): FLOPs are counted as 2 x (matmul parameters) per token of prompt and
response, plus 4 x layers x width x context for attention. The engine's start-up (first and later)
and the memory it adds to the process (its KV cache is VLLM_CPU_KVCACHE_SPACE GiB) are stated.

Writes ``rollout_engines.md`` and ``rollout_engines.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

MODELS = {  # name -> (build_tiny_qwen2 overrides, prompts per step, new tokens)
    "Qwen2 2x128": (dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2), 4, 32),
    "Qwen2 4x256": (dict(hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=4,
                         num_hidden_layers=4), 4, 128),
}
GROUP = 4


def rss_mib() -> float:
    """This process's resident memory (MiB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def matmul_peak(n: int = 1024, repeats: int = 10) -> float:
    """fp32 FLOP/s of the best of ``repeats`` n x n matmuls on this thread."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(repeats))
    return 2 * n**3 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def flops(model, rollout) -> float:
    """The forward FLOPs of sampling ``rollout``: every prompt and response token through the model."""
    cfg = model.config
    matmul = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name)
    if getattr(cfg, "tie_word_embeddings", False):
        matmul += model.get_input_embeddings().weight.numel()  # the LM head multiplies by the embedding
    P, lengths = rollout.prompt_len, rollout.lengths.double()
    tokens = float((P + lengths).sum())
    context = float(((P + lengths) * (P + lengths + 1) / 2).sum())  # sum over positions of the context attended
    return 2 * matmul * tokens + 4 * cfg.num_hidden_layers * cfg.hidden_size * context


def model_rows(name: str, overrides: dict, prompts_per_step: int, new_tokens: int, rounds: int, tmp: Path) -> dict:
    from tiny_models import build_tiny_qwen2

    from gradnorm.trainer import engine_rollout
    from gradnorm.trainer.config import parse_config
    from gradnorm.trainer.policy import build_policy
    from gradnorm.trainer.rollout import generate_rollout

    path = build_tiny_qwen2(tmp / name.replace(" ", "_"), seed=0, **overrides)
    cfg = parse_config(["--model", str(path), "--prompts", str(ROOT / "examples" / "arithmetic.jsonl"),
                        "--reward", "exact_match_math", "--prompts-per-step", str(prompts_per_step),
                        "--group-size", str(GROUP), "--max-new-tokens", str(new_tokens),
                        "--rollout-engine", "vllm", "--seed", "1"])
    task, policy = build_policy(cfg, torch.device("cpu"))
    policy.model.eval()
    before = rss_mib()
    t = time.perf_counter()
    engine = engine_rollout.EngineRollouts(cfg, task, policy)  # starts vLLM and loads the policy's weights
    start = time.perf_counter() - t
    added = rss_mib() - before
    kwargs = dict(num_prompts=prompts_per_step, group_size=GROUP, seed=1, temperature=1.0)
    builtin = lambda step: generate_rollout(policy, task, step=step, **kwargs)  # noqa: E731
    vllm = lambda step: engine.generate(policy, task, step=step, **kwargs)  # noqa: E731
    builtin(0), vllm(0)  # warm both: first calls allocate
    times = {"builtin": [], "vllm": []}
    fl = {"builtin": [], "vllm": []}
    for r in range(1, rounds + 1):
        order = [("builtin", builtin), ("vllm", vllm)][:: 1 if r % 2 else -1]
        for key, fn in order:
            t = time.perf_counter()
            rollout = fn(r)
            times[key].append(time.perf_counter() - t)
            fl[key].append((flops(policy.model, rollout), int(rollout.mask.sum())))
    out = {"model": name, "batch": f"{prompts_per_step} x {GROUP}, {new_tokens} new", "engine_start_s": start,
           "engine_rss_mib": added, "params": sum(p.numel() for p in policy.model.parameters())}
    for key in times:
        out[key] = {"median_s": statistics.median(times[key]),
                    "tokens_per_s": sum(n for _, n in fl[key]) / sum(times[key]),
                    "flops_per_s": sum(f for f, _ in fl[key]) / sum(times[key])}
    return out


def cold_start_s() -> float:
    """A first engine start in a fresh process (vllm's import included), of the tiny model."""
    code = ("import time, sys; t = time.perf_counter(); sys.path.insert(0, %r);"
            "from tiny_models import build_tiny_qwen2; import tempfile;"
            "from gradnorm.models.vllm_engine import VLLMEngine;"
            "d = build_tiny_qwen2(tempfile.mkdtemp(), hidden_size=128, intermediate_size=256, num_attention_heads=2,"
            " num_key_value_heads=2); t = time.perf_counter(); VLLMEngine(str(d), max_model_len=96);"
            "print('START', time.perf_counter() - t)") % str(ROOT / "examples")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("START")]
    return float(lines[-1].split()[1]) if lines else float("nan")


def render(result: dict) -> str:
    peak = result["matmul_peak"]
    lines = ["# Rollout engines: vLLM's CPU build against the built-in decode", "",
             f"Generated by `{result['command']}` in {result['seconds']:.0f} s on {os.cpu_count()} CPUs "
             f"({result['platform']}), torch {result['torch']}, vllm {result['vllm']}, one process, one thread. "
             f"Load average {result['load'][0]:.1f} before and {result['load'][1]:.1f} after: the machine is "
             "shared, so the ratios, measured side by side, are worth more than the times.", "",
             f"Medians over {result['rounds']} rounds of one step's rollout batch (prompts x group), the engines "
             f"alternating. This thread's fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s (1024 x 1024, best of 10). "
             f"A first engine start in a fresh process took {result['cold_start_s']:.1f} s.", "",
             "| model | batch | builtin (s) | vllm (s) | builtin / vllm | tokens/s builtin, vllm | "
             "share of peak builtin, vllm | engine start (s) | engine memory (MiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        b, v = r["builtin"], r["vllm"]
        lines.append(f"| {r['model']} ({r['params'] / 1e6:.2f}M) | {r['batch']} | {b['median_s']:.3f} | "
                     f"{v['median_s']:.3f} | {b['median_s'] / v['median_s']:.2f}x | {b['tokens_per_s']:.0f}, "
                     f"{v['tokens_per_s']:.0f} | {b['flops_per_s'] / peak:.1%}, {v['flops_per_s'] / peak:.1%} | "
                     f"{r['engine_start_s']:.1f} | {r['engine_rss_mib']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="batches each engine samples, per model")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks", help="folder for rollout_engines.md and .json")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from gradnorm.models import vllm_engine

    vllm = vllm_engine.import_vllm()  # an EngineError naming the install when it is missing
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    cold = cold_start_s()
    peak = matmul_peak()
    rows = []
    with tempfile.TemporaryDirectory(prefix="rollout-engines-") as tmp:
        for name, (overrides, prompts, new) in MODELS.items():
            rows.append(model_rows(name, overrides, prompts, new, args.rounds, Path(tmp)))
            print(f"{name}: done", flush=True)
    argv_text = " ".join(argv if argv is not None else sys.argv[1:])
    result = {"command": f"python benchmarks/rollout_engines.py {argv_text}".strip(), "rounds": args.rounds,
              "seconds": time.perf_counter() - t0, "load": [load0, os.getloadavg()[0]], "matmul_peak": peak,
              "cold_start_s": cold, "platform": platform.platform(), "torch": torch.__version__,
              "vllm": vllm.__version__, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rollout_engines.json").write_text(json.dumps(result, indent=1) + "\n")
    text = render(result)
    (args.out / "rollout_engines.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
