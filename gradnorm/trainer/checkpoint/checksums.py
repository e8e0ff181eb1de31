"""A sha256 beside every file of a checkpoint, written with the file and checked before it is read.

A checkpoint's bytes can change after it is written (a bad disk, a partial copy, a stray write)
and still parse: DCP's shards hold raw tensor bytes, and 8 bytes overwritten inside one load
silently as other weights. So every file gets a sidecar ``NAME.sha256`` holding ``digest  NAME``
(the format of ``sha256sum``, so ``sha256sum -c ckpt_step10/*.sha256`` checks a checkpoint by
hand):

    written by   rank r: its own shards ``__{r}_*.distcp``, as soon as DCP has written them;
                 rank 0: ``.metadata`` and ``trainer_state.json``
    checked by   the ranks that load, split between them (rank r checks the shards r, r + W, ...),
                 agreeing with one all-reduce, so no rank hashes more than its share of the bytes

A checkpoint whose ``.metadata.sha256`` is absent predates checksums and loads unchecked; in one
that has it, a shard without its sidecar is refused as a mismatch would be.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from gradnorm.dist import comm

SUFFIX = ".sha256"
MARKER = ".metadata" + SUFFIX  # present: every file of the checkpoint carries a checksum
_CHUNK = 1 << 20


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write(path: Path) -> None:
    """``path.sha256``, synced to disk (before the checkpoint's rename publishes it)."""
    sidecar = path.with_name(path.name + SUFFIX)
    with open(sidecar, "w") as f:
        f.write(f"{digest(path)}  {path.name}\n")
        f.flush()
        os.fsync(f.fileno())


def write_shards(directory: Path, rank: int) -> None:
    """This rank's shards' checksums; rank 0 adds the index's (``.metadata``, written by DCP's coordinator)."""
    for shard in sorted(directory.glob(f"__{rank}_*.distcp")):
        write(shard)
    if rank == 0:
        write(directory / ".metadata")


def mismatch(path: Path) -> str | None:
    """Why ``path`` fails its checksum (a sidecar exists or is required), or None when it matches."""
    sidecar = path.with_name(path.name + SUFFIX)
    try:
        recorded = sidecar.read_text().split()[0]
    except FileNotFoundError:
        return f"{path.name} has no {SUFFIX} checksum beside it"
    except (OSError, IndexError, UnicodeDecodeError):
        return f"{sidecar.name} is unreadable"
    return None if digest(path) == recorded else f"{path.name} does not match the sha256 written with it"


def checked(directory: Path) -> bool:
    """Whether the checkpoint was written with checksums (an older one was not)."""
    return (directory / MARKER).exists()


def verify_shards(directory: Path, rank: int, world_size: int) -> str | None:
    """The first file of the checkpoint that fails its checksum, as found by any rank, or None.

    Rank r hashes every W-th file from the r-th; one all-reduce tells every rank the first failure
    (by index), so all of them refuse with the same words. With ``world_size > 1`` every rank must call it.
    """
    files = sorted(directory.glob("*.distcp")) + [directory / ".metadata"]
    first = len(files)
    for index in range(rank, len(files), world_size):
        if mismatch(files[index]) is not None:
            first = index
            break
    if world_size > 1:  # the lowest failing index over ranks
        first = -int(comm.all_reduce_max(torch.tensor([-first], dtype=torch.int64))[0])
    return None if first == len(files) else (mismatch(files[first]) or f"{files[first].name} failed on another rank")
