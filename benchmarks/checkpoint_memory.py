"""Rank 0's peak host memory while saving an FSDP2 checkpoint: sharded (DCP) against gathered.

    python benchmarks/checkpoint_memory.py                      # ~50 MB of weights, 2 gloo ranks
    python benchmarks/checkpoint_memory.py --n-embd 768 --world-size 4
    python benchmarks/checkpoint_memory.py --out benchmarks     # also write checkpoint_memory.md

A TinyGPT on 2 spawned gloo ranks (CPU), wrapped in FSDP2, takes one AdamW step, so every rank
holds its shard of the weights and of AdamW's two moments. Then rank 0's host memory is measured
around one save, with each way of saving in its own fresh pair of processes (a freed allocation
would otherwise be reused by the next one and hide it):

- ``sharded``: ``gradnorm.trainer.checkpoint.store.save``, what the trainer does. Every rank writes its own
  shards with torch.distributed.checkpoint.
- ``gathered``: what the trainer did before: ``get_model_state_dict`` and
  ``get_optimizer_state_dict`` with ``full_state_dict=True, cpu_offload=True`` (every full tensor
  arrives on rank 0's CPU), then one ``torch.save`` by rank 0.

What is measured, and why so. ``tracemalloc`` does not see torch's allocations (they bypass
Python's allocator), but the kernel does: rank 0 resets its resident-set high-water mark (writing
5 to ``/proc/self/clear_refs``, Linux) just before the save and reads ``VmHWM`` from
``/proc/self/status`` right after it, having first returned the memory freed by the step to the
kernel (glibc's ``malloc_trim``), which the save would otherwise reuse unseen. Peak minus the resident set before the save is the most
memory the save added at any instant, however brief (no sampling thread to miss a spike). The
state's size is counted from the tensors themselves: the full state (weights + 2 moments) and
rank 0's shard of it.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import time
from pathlib import Path

try:  # run as a script from a plain checkout
    import gradnorm  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from gradnorm.trainer.checkpoint import store
from gradnorm.dist import comm, wrap
from gradnorm.dist import state as dist_state
from gradnorm.dist.spawn import spawn_gloo
from gradnorm.models.tinygpt import GPTConfig, TinyGPT

MB = 2**20


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _local_bytes(state) -> int:
    """Bytes of this rank's part of a state (a DTensor counts its local shard)."""
    return sum(getattr(t, "_local_tensor", t).numel() * t.element_size() for _, t in dist_state.tensor_leaves(state))


def _gathered_save(model, opt, path: Path, is_main: bool) -> None:
    # The previous format, for comparison: full model and full AdamW state on rank 0, one file.
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = {"model": get_model_state_dict(model, options=full),
             "optimizer": get_optimizer_state_dict(model, opt, options=full)}
    if is_main:
        torch.save(state, path / "ckpt.pt")


def _measure(ctx: comm.DistContext, method: str, n_layer: int, n_embd: int, out_dir: str) -> dict:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=32, block_size=64, n_layer=n_layer, n_head=8, n_embd=n_embd))
    model = wrap.wrap_fsdp(model, blocks=list(model.blocks))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randint(0, 32, (2, 16))).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    state = dist_state.training_state(model, opt)
    full_bytes = sum(t.numel() * t.element_size() for _, t in dist_state.tensor_leaves(state))  # global shapes
    shard = torch.tensor([_local_bytes(state)], dtype=torch.float64)
    path = Path(out_dir) / method
    comm.barrier()
    # Freed memory (the step's gradients) stays resident in glibc's heap and would be reused by the
    # save unseen; hand it back to the kernel first, so the save's own allocations show.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # reset this process's peak resident set
    before, t0 = _status_kib("VmRSS"), time.perf_counter()
    if method == "sharded":
        store.save(path, 1, state, {"step": 1}, ctx.rank)
    else:
        path.mkdir(parents=True, exist_ok=True)
        _gathered_save(model, opt, path, ctx.is_main)
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    comm.barrier()
    written = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return {"method": method, "full_state_mb": full_bytes / MB, "rank0_shard_mb": float(shard) / MB,
            "peak_extra_mb": (peak - before) / 1024, "seconds": seconds, "written_mb": written / MB}


def measure(method: str, world_size: int = 2, n_layer: int = 4, n_embd: int = 512) -> dict:
    """Rank 0's numbers for one way of saving, in a fresh set of ``world_size`` gloo processes."""
    with tempfile.TemporaryDirectory() as out_dir:
        return spawn_gloo(_measure, world_size, method, n_layer, n_embd, out_dir)[0]


def render(rows: list[dict], world_size: int, n_layer: int, n_embd: int, out: str | None = None) -> str:
    first = rows[0]
    lines = [
        "# Checkpoint memory under FSDP2 (rank 0's host memory during one save)",
        "",
        f"Generated by `python benchmarks/checkpoint_memory.py --world-size {world_size} --n-layer {n_layer} "
        f"--n-embd {n_embd}{f' --out {out}' if out else ''}`: TinyGPT on {world_size} gloo ranks (CPU), after one AdamW step. Full state "
        f"(weights + 2 AdamW moments, fp32) {first['full_state_mb']:.1f} MB; rank 0's shard of it "
        f"{first['rank0_shard_mb']:.1f} MB.",
        "",
        "| save | rank 0's peak extra resident memory (MB) | as a share of the full state | written (MB) | seconds |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['method']} | {r['peak_extra_mb']:.1f} | {r['peak_extra_mb'] / r['full_state_mb']:.2f} | "
                     f"{r['written_mb']:.1f} | {r['seconds']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--out", default=None, help="folder to write checkpoint_memory.md into")
    args = parser.parse_args(argv)
    rows = [measure(method, args.world_size, args.n_layer, args.n_embd) for method in ("gathered", "sharded")]
    text = render(rows, args.world_size, args.n_layer, args.n_embd, args.out)
    print(text)
    if args.out:
        Path(args.out, "checkpoint_memory.md").write_text(text)


if __name__ == "__main__":
    main()
