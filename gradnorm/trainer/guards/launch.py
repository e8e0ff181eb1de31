"""Who this process is in the job: torchrun's (or srun's) variables checked whole, its rank, the
ranks that share its host, the device it trains on, and that every rank got the same flags.

A stale shell exports some of torchrun's variables; each check says so in one line before any
process group is joined.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch

from gradnorm.dist import comm
from gradnorm.trainer.config import TrainConfig

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch_environment(environ=os.environ) -> tuple[int, int]:
    """(rank, world_size): (0, 1) for a plain process, torchrun's values otherwise.

    torchrun exports RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT together. Some of them alone are
    a leftover of another launch (an exported WORLD_SIZE=4 would make one process validate the batch
    for 4 ranks; RANK without MASTER_ADDR would fail in torch's rendezvous): say so in one line.
    """
    present = [name for name in TORCHRUN_VARS if name in environ]
    if not {"RANK", "WORLD_SIZE"} & set(present):
        return 0, 1
    given = " ".join(f"{name}={environ[name]}" for name in present)
    missing = [name for name in TORCHRUN_VARS if name not in environ]
    if missing:
        raise ValueError(f"the environment sets {given} but not {', '.join(missing)}: a leftover of another launch? "
                         f"unset {' '.join(present)} to run one process, or launch with torchrun")
    try:
        rank, world_size, port = (int(environ[name]) for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"))
    except ValueError:
        raise ValueError(f"RANK={environ['RANK']}, WORLD_SIZE={environ['WORLD_SIZE']} and "
                         f"MASTER_PORT={environ['MASTER_PORT']} must be integers; launch with torchrun") from None
    if not 0 <= rank < world_size or not 0 < port < 65536:
        raise ValueError(f"RANK={rank} WORLD_SIZE={world_size} MASTER_PORT={port}: expected 0 <= RANK < WORLD_SIZE "
                         "and a port in 1..65535; launch with torchrun")
    if not launched_by_an_agent(environ):  # else it would wait --timeout-s for ranks that never come, in silence
        raise ValueError(f"the environment sets {given} but no launcher started this process (no TORCHELASTIC_RUN_ID "
                         "from torchrun, no SLURM_PROCID equal to RANK): a leftover of another launch? unset "
                         f"{' '.join(present)} to run one process, or launch with torchrun")
    if environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        check_agent_store(environ)
    return rank, world_size


class NoLauncher(ValueError):
    """torchrun's variables, and no live launcher behind them: the process is alone, so it reports
    as rank 0 does, at once (other ranks wait for rank 0 to speak first: ``failures.report_error``)."""


def check_agent_store(environ=os.environ, timeout: float = 5.0) -> None:
    """torchrun's agent serves the job's store at MASTER_ADDR:MASTER_PORT before it starts a worker;
    none answering there means the variables were copied from a job that has ended. Without this,
    joining retries, printing C++ connection errors, until its timeout."""
    import socket

    host, port = environ["MASTER_ADDR"], int(environ["MASTER_PORT"])
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        why = getattr(err, "strerror", None) or type(err).__name__
        raise NoLauncher(f"the environment names torchrun job {environ['TORCHELASTIC_RUN_ID']!r}, but no store answers "
                         f"at MASTER_ADDR:MASTER_PORT {host}:{port} ({why}): copied from a launch that has ended? unset "
                         "RANK WORLD_SIZE MASTER_ADDR MASTER_PORT and the TORCHELASTIC_* variables to run one process, "
                         "or launch with torchrun") from None


def launched_by_an_agent(environ=os.environ) -> bool:
    """Whether a launcher started this process: torchrun's agent (TORCHELASTIC_RUN_ID, which a shell
    never exports), or srun with RANK mapped from SLURM_PROCID. A complete set of torchrun's
    variables without either is a stale shell."""
    return "TORCHELASTIC_RUN_ID" in environ or environ.get("SLURM_PROCID", "") == environ.get("RANK")


def error_rank(environ=os.environ) -> int:
    """Who this process is when reporting an error: torchrun's RANK in a complete torchrun environment, else 0."""
    complete = all(name in environ for name in TORCHRUN_VARS) and environ["RANK"].isdigit()
    return int(environ["RANK"]) if complete and launched_by_an_agent(environ) else 0


def device_of(cfg: TrainConfig, environ=os.environ) -> torch.device:
    """The device this rank will train on: --device (auto: CUDA when available), GPU LOCAL_RANK."""
    return comm.local_device(None if cfg.device == "auto" else cfg.device, environ)


def local_ranks(environ=os.environ) -> int:
    """Processes of this job on this host (torchrun's LOCAL_WORLD_SIZE), which share its RAM; 1 for a
    plain process, whatever a stale shell exports. A one-line ValueError for a value that is not >= 1."""
    value = environ.get("LOCAL_WORLD_SIZE", "1")
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        return 1
    if not (value.isascii() and value.isdigit() and int(value) >= 1):
        raise ValueError(f"LOCAL_WORLD_SIZE={value}: expected the number of processes of this job on this host (an "
                         "integer >= 1); launch with torchrun, which sets it")
    return int(value)


def flags_digest(cfg: TrainConfig) -> int:
    """A 56-bit digest of every flag: equal on every rank of one command line (compared before rank 0
    resolves --auto-resume into --resume or --overwrite, which the other ranks then learn from it)."""
    flags = cfg.to_dict()
    return int.from_bytes(hashlib.sha256(json.dumps(flags, sort_keys=True, default=str).encode()).digest()[:7], "big")


def check_same_command(cfg: TrainConfig) -> None:
    """A one-line ValueError on every rank when the ranks were started with different flags.

    Each node's agent starts its workers with its own command line, so a node launched with another
    --lr or --steps would train a different run in the same process group. One all-reduce of two
    numbers (the digest's max, and its min as the max of its negation), whatever W; they are equal
    exactly when every rank's digest is.
    """
    digest = flags_digest(cfg)
    high, negated_low = comm.all_reduce_max(torch.tensor([digest, -digest], dtype=torch.int64)).tolist()
    if high != -negated_low:
        raise ValueError("the ranks were started with different flags (their digests differ; this rank's: "
                         f"{digest:014x}): start every node with the same command line")
