"""The process group and its collectives: setup, THE all-reduce of counts, rank-0 printing.

It sets up the process group (NCCL on CUDA, gloo on CPU, chosen automatically), performs the one
all-reduce of counts per minibatch, reduces logging statistics (sums; the max of phase times),
gathers the sharded rollouts, sends scored log-probs to the ranks that train on them, and prints
on rank 0. Every function also works in a plain single process with no process group, where a
reduction or a gather is the identity.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import Tensor

from gradnorm.core.denominators import (
    Counts,
    Denominator,
    needs_global_counts,
    rank_count_vector,
)


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job."""

    rank: int
    """Global rank, 0..world_size-1."""
    world_size: int
    """W: number of data-parallel ranks."""
    local_rank: int
    """Rank on this node; picks the GPU."""
    device: torch.device
    """Where this rank's model and tensors live."""
    backend: str | None
    """"nccl", "gloo", or None for a plain single process without a process group."""

    @property
    def is_main(self) -> bool:
        """Rank 0 alone prints and writes files."""
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """torchrun (and torch.multiprocessing helpers that mimic it) export RANK and WORLD_SIZE."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def default_backend(device_type: str) -> str:
    """NCCL for CUDA tensors, gloo for CPU tensors."""
    return "nccl" if device_type == "cuda" else "gloo"


def local_device(device: str | None = None, environ=os.environ) -> torch.device:
    """The device this process trains on: ``device`` ("cuda" or "cpu"; None: CUDA when available),
    the GPU of its LOCAL_RANK (never RANK: on N nodes, ranks beyond the first node's GPUs exist too).
    The preflight's memory estimate asks the same question before any process group exists."""
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    local = environ.get("LOCAL_RANK", environ.get("RANK", "0"))
    return torch.device("cuda", int(local) if local.isdigit() else 0) if kind == "cuda" else torch.device("cpu")


def setup(backend: str | None = None, device: str | None = None, timeout_s: float = 300.0) -> DistContext:
    """Join the process group if torchrun launched us; otherwise describe a single process.

    ``device`` defaults to CUDA when available; ``backend`` defaults to NCCL on CUDA and gloo on
    CPU. ``timeout_s`` bounds how long a collective waits for a dead peer before raising.
    """
    if not launched_by_torchrun():
        return DistContext(rank=0, world_size=1, local_rank=0, device=local_device(device, {}), backend=None)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    dev = local_device(device)
    backend = backend or default_backend(dev.type)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    global _store, _joined
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        store = _rendezvous_store(rank, world_size, timeout)
        # Every key of this start under its own prefix: after torchrun restarts the group, the store
        # still held the dead group's gloo addresses, and a restarted rank sometimes read one and
        # failed to connect ("Connection refused" at the old peer's port), ending the elastic run.
        dist.init_process_group(backend=backend, store=dist.PrefixStore(f"gradnorm/attempt_{_attempt()}", store),
                                rank=rank, world_size=world_size, timeout=timeout)
        _store = store  # where a failing rank leaves its error for the others (``post_error``)
        _joined = True
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, device=dev, backend=backend)


def _attempt() -> str:
    """Which start of the group this is: torchrun counts its restarts (0 for the first start)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def _rendezvous_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The job's TCPStore at MASTER_ADDR:MASTER_PORT: torchrun's agent hosts it (every rank a client), or,
    launched without an agent (srun), rank 0 does."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                         is_master=not agent and rank == 0, timeout=timeout, multi_tenant=not agent)


def teardown() -> None:
    """Leave the process group that ``setup`` joined (call from a ``finally``); one this module did
    not create is left alone: in one plain process vLLM makes a group of its own, which its shutdown
    destroys after the trainer's exit (destroyed here first, that shutdown raised "Invalid process
    group specified" into the end of a run that had succeeded)."""
    global _store, _joined
    _store = None
    if _joined and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _joined = False


def exit_without_finalizing(code: int) -> NoReturn:
    """End a worker process now, with ``code``, skipping the interpreter's finalization.

    Call it once everything is written, closed and torn down. A gloo worker thread may still be
    dropping the last collective's tensors, which takes the GIL; during finalization that aborts
    the process ("terminate called without an active exception", SIGABRT) now and then, and the
    launcher reports the worker as failed. Seen here under load on torchrun's workers and on
    spawned gloo ranks alike (a core dump shows the gloo thread in ``~AsyncAllgatherWork`` taking
    the GIL inside ``Py_FinalizeEx``). ``os._exit`` skips finalization; coverage still saves its
    data (``patch = _exit``).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ------------------------------------------------------------------ a failure on one rank, told to every rank
#
# A rank that fails while its peers wait in a collective (a reward that raises on rank 1 only)
# leaves its one-line message in the rendezvous store, then leaves the process group: gloo closes
# its connections, so the peers' collective fails at once (instead of after --timeout-s) with a
# RuntimeError ("Connection reset by peer"). A peer that sees that error reads the store and
# reports the failing rank's message instead of its own traceback.

_store = None
_joined = False  # whether ``setup`` created the default process group (``teardown`` destroys only that one)
ERROR_KEY = "gradnorm/error/{attempt}/{rank}"  # per restart of the group: never an earlier attempt's error


def _error_key(rank: int) -> str:
    return ERROR_KEY.format(attempt=_attempt(), rank=rank)


def post_error(message: str) -> None:
    """Leave this rank's error for the others, then leave the process group (gloo: the peers' wait ends now)."""
    if _store is not None and _active():
        try:
            _store.set(_error_key(dist.get_rank()), message)
        except RuntimeError:  # the store is gone with rank 0 or the agent: nobody left to tell
            pass
    if _active() and dist.get_backend() == "gloo":  # NCCL's destroy can block on a peer; its timeout ends the wait
        teardown()


def posted_errors(world_size: int) -> dict[int, str]:
    """{rank: message} of the ranks that failed and said so (``post_error``); {} without a store."""
    found = {}
    for rank in range(world_size):
        key = _error_key(rank)
        try:
            if _store is not None and _store.check([key]):
                found[rank] = _store.get(key).decode(errors="replace")
        except RuntimeError:
            break
    return found


def is_collective_failure(err: BaseException) -> bool:
    """Whether ``err`` is a collective that failed because of a peer: it died, left, or timed out."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(s in text for s in (
        "third_party/gloo", "Connection closed by peer", "Connection reset by peer", "Timed out waiting", "NCCL",
        "Application timeout caused pair closure"))  # gloo, when a peer stops (SIGSTOP) inside a collective


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 0


def world_size() -> int:
    """The number of ranks in the process group; 1 without one."""
    return dist.get_world_size() if _active() else 1


def all_reduce_sum(tensor: Tensor) -> Tensor:
    """Sum ``tensor`` over ranks, in place; the identity without a process group."""
    if _active():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather(tensor: Tensor) -> Tensor:
    """Every rank's ``tensor`` (same shape on all), stacked in rank order: (W, *tensor.shape).

    The identity without a process group: ``tensor[None]``. Used once per rollout batch, to give
    every rank the sequences the other ranks sampled (``rollout.generate_rollout``).
    """
    if not _active():
        return tensor[None]
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.stack(parts)


def all_to_all_rows(rows: Tensor, send_counts: list[int], recv_counts: list[int]) -> Tensor:
    """Rows to the ranks that need them, in one all-to-all.

    ``rows`` (n, ...) go out in rank order: the first ``send_counts[0]`` to rank 0, the next
    ``send_counts[1]`` to rank 1, and so on; the result holds the rows every rank sent here, rank
    0's first (``recv_counts[p]`` from rank p). The identity without a process group. Used once
    per scored rollout batch, to give every rank the log-probs of its rows (``step.route``).
    """
    if not _active():
        if len(send_counts) != 1:
            raise RuntimeError(f"sending rows to {len(send_counts)} ranks needs their process group")
        return rows
    out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv_counts, send_counts)
    return out


def all_true(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank: one all-reduce of one int (``flag`` itself alone).

    Lets every rank take the same decision after a step only some ranks can fail (rank 0's file
    writes in a checkpoint), so none is left waiting in the next collective.
    """
    if not _active():
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    failed = torch.tensor([0 if flag else 1], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.SUM)
    return int(failed) == 0


def all_reduce_max(tensor: Tensor) -> Tensor:
    """Max of ``tensor`` over ranks, in place (the trainer's phase times); the identity alone.

    NCCL reduces CUDA tensors only, so a CPU tensor makes a round trip to this rank's GPU there.
    """
    if _active():
        on_device = tensor.cuda() if dist.get_backend() == "nccl" else tensor
        dist.all_reduce(on_device, op=dist.ReduceOp.MAX)
        tensor.copy_(on_device)
    return tensor


def barrier() -> None:
    """Wait for every rank (used to line ranks up before a timed region); no-op alone."""
    if _active():
        dist.barrier()


def first_failure(message: str | None) -> tuple[int, str] | None:
    """(rank, message) of the lowest rank whose ``message`` is not None, the same on every rank; None
    when every rank passed. Every rank calls it. Two collectives whatever W: a MIN all-reduce of one
    number (the failing ranks' own numbers, W for a rank that passed), then that rank's line broadcast."""
    if not _active():
        return None if message is None else (0, message)
    W = dist.get_world_size()
    first = torch.tensor([W if message is None else dist.get_rank()], dtype=torch.int64)
    on_device = first.cuda() if dist.get_backend() == "nccl" else first
    dist.all_reduce(on_device, op=dist.ReduceOp.MIN)
    rank = int(on_device.item())
    return None if rank == W else (rank, broadcast_object(message, src=rank))


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s picklable ``obj`` on every rank (a small decision, not tensors); ``obj`` alone."""
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def global_counts(
    microbatches: Sequence[Tensor], lengths: Tensor, group_ids: Tensor, num_groups: int, denominator: Denominator,
) -> Counts | None:
    """THE collective of the fix: one all-reduce of the small int64 count vector per minibatch.

    Counts this rank's response tokens over all its microbatches (``microbatches[m]`` indexes
    ``lengths`` (S,) and ``group_ids`` (S,), on the rank's device) into ``[N, S_tok, N_0..N_{G-1}]``
    and sums the vector over ranks. Every rank must call this once per minibatch, before its
    first forward pass, even a rank that holds no response tokens (its vector is zeros), so no
    rank waits on one that skipped it. ``local`` and a constant need no counts: None, and no
    collective (the same decision on every rank, so none is left waiting).
    """
    if not needs_global_counts(denominator):
        return None
    summed = all_reduce_sum(rank_count_vector(microbatches, lengths, group_ids, num_groups))
    return Counts.from_vector(summed.cpu())


def print0(*args, **kwargs) -> None:
    """print on rank 0 only."""
    if not _active() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)
