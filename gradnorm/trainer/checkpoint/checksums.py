"""A checkpoint's files bound to it: a sha256 beside every file, and a manifest per rank that lists
its files with their digests and the checkpoint's step; all checked before anything is read.

A checkpoint's bytes can change after it is written (a bad disk, a partial copy, a stray write)
and still parse: DCP's shards hold raw tensor bytes, and 8 bytes overwritten inside one load
silently as other weights. A sidecar per file catches that, but alone it binds a file to nothing:
a shard copied with its sidecar from ckpt_step2 into ckpt_step3 matched, and a deleted sidecar read
as "written before checksums". So each rank also writes ``manifest.rank{r}.json``:

    {"step": N, "world_size": W, "files": {"__r_0.distcp": "<sha256>", ...}}

    written by   rank r: its own shards ``__{r}_*.distcp`` and their sidecars, as soon as DCP has
                 written them; rank 0: its shards, ``.metadata`` and ``trainer_state.json``, just
                 before the rename publishes the checkpoint (nothing funnels through one rank)
    checked by   every rank: the manifests agree (ranks 0..W-1, one step, the step of the
                 directory's name) and list exactly the files present; then the files' bytes, split
                 between the loading ranks (rank r hashes the files r, r + W, ...), agreeing with one
                 all-reduce, so no rank hashes more than its share

Each sidecar holds ``digest  NAME``, the format of ``sha256sum``, so a checkpoint is checked by
hand with ``cd ckpt_step10 && sha256sum -c .metadata.sha256 *.sha256`` (``*`` misses dot files).
A file's sidecar must name the manifest's digest (upper or lower case, as ``sha256sum -c`` takes).

A checkpoint with no sidecar and no manifest predates checksums and loads unchecked; one that holds
any of them was written with checksums and must be complete: a missing sidecar or manifest is
refused as a mismatch would be. A sidecar or file that is not a regular file (a FIFO would block
the reader) is refused without being opened.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path

import torch

from gradnorm.dist import comm

SUFFIX = ".sha256"
MANIFEST = "manifest.rank{rank}.json"
_MANIFEST = re.compile(r"^manifest\.rank(\d+)\.json$")
_HEX = re.compile(r"^[0-9a-fA-F]{64}$")
_CHUNK = 1 << 20


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())  # on disk before the checkpoint's rename publishes it


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + SUFFIX)


def seal(directory: Path, rank: int, world_size: int, step: int, names: list[str]) -> None:
    """This rank's part: a sidecar beside each of ``names`` and ``manifest.rank{rank}.json`` listing them."""
    files = {}
    for name in names:
        files[name] = digest(directory / name)
        _write_synced(_sidecar(directory / name), f"{files[name]}  {name}\n")
    manifest = {"step": step, "world_size": world_size, "files": files}
    _write_synced(directory / MANIFEST.format(rank=rank), json.dumps(manifest, indent=1) + "\n")


def own_shards(directory: Path, rank: int) -> list[str]:
    """The shard files rank ``rank`` wrote (DCP names them ``__{rank}_{i}.distcp``)."""
    return sorted(p.name for p in directory.glob(f"__{rank}_*.distcp"))


def write(path: Path) -> None:
    """Record ``path``'s current bytes as its checksum: its sidecar, and its digest in the manifest
    that lists it. Whoever rewrites a file on purpose does this (the tests' attackers, to show the
    unpickler holds without the checksums' help); a save calls ``seal``."""
    value = digest(path)
    _write_synced(_sidecar(path), f"{value}  {path.name}\n")
    for manifest_path in path.parent.glob("manifest.rank*.json"):
        manifest = json.loads(manifest_path.read_text())
        if path.name in manifest.get("files", {}):
            manifest["files"][path.name] = value
            _write_synced(manifest_path, json.dumps(manifest, indent=1) + "\n")


def checked(directory: Path) -> bool:
    """Whether the checkpoint was written with checksums: it holds any sidecar or manifest."""
    try:
        names = os.listdir(directory)
    except OSError:
        return False
    return any(name.endswith(SUFFIX) or _MANIFEST.match(name) for name in names)


def data_files(directory: Path) -> list[str]:
    """The files a checkpoint's readers open: the shards, DCP's index and the counters."""
    names = sorted(p.name for p in directory.glob("*.distcp"))
    return names + [name for name in (".metadata", "trainer_state.json") if (directory / name).exists()]


def _regular(path: Path) -> bool:
    """Whether ``path`` is a regular file (a FIFO would block ``open``, a directory fail it)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _read_manifest(path: Path) -> dict | str:
    """The manifest at ``path``, or why it cannot be one."""
    if not _regular(path):
        return f"{path.name} is not a regular file"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return f"{path.name} is unreadable ({type(err).__name__})"
    ok = (isinstance(manifest, dict) and type(manifest.get("step")) is int and type(manifest.get("world_size")) is int
          and isinstance(manifest.get("files"), dict)
          and all(isinstance(k, str) and isinstance(v, str) and _HEX.match(v) for k, v in manifest["files"].items()))
    return manifest if ok else f"{path.name} is not a manifest of this format"


def manifests(directory: Path) -> dict[int, dict] | str:
    """Every rank's manifest, by rank, checked against each other; or the first thing wrong with them."""
    found = {int(m.group(1)): directory / name for name in sorted(os.listdir(directory))
             if (m := _MANIFEST.match(name))}
    if not found:  # deleted, or a checkpoint of a gradnorm that wrote sidecars but no manifests yet
        return (f"{MANIFEST.format(rank=0)} is missing, the list of its files and their sha256; if a gradnorm "
                "from before manifests wrote it, `sha256sum -c .metadata.sha256 *.sha256` in it and then deleting "
                "its .sha256 files loads it unchecked")
    if 0 not in found:
        return f"{MANIFEST.format(rank=0)} is missing (the list of rank 0's files and their sha256)"
    read = {}
    for rank, path in sorted(found.items()):
        manifest = _read_manifest(path)
        if isinstance(manifest, str):
            return manifest
        read[rank] = manifest
    world_size, step = read[0]["world_size"], read[0]["step"]
    for rank in range(max(world_size, max(read) + 1)):
        if rank not in read:
            return f"{MANIFEST.format(rank=rank)} is missing (rank 0's says {world_size} ranks wrote it)"
        if rank >= world_size or read[rank]["world_size"] != world_size:
            return f"{MANIFEST.format(rank=rank)} does not belong with {MANIFEST.format(rank=0)} ({world_size} ranks)"
        if read[rank]["step"] != step:
            return (f"{MANIFEST.format(rank=rank)} is of step {read[rank]['step']}, "
                    f"{MANIFEST.format(rank=0)} of step {step}")
    return read


def recorded_step(directory: Path) -> int | None:
    """The step rank 0's manifest binds the checkpoint to (None: no readable manifest)."""
    manifest = _read_manifest(directory / MANIFEST.format(rank=0))
    return None if isinstance(manifest, str) else manifest["step"]


def _listed(directory: Path) -> list[tuple[str, str]] | str:
    """(name, digest) of every file the manifests list, which must be exactly the files present."""
    read = manifests(directory)
    if isinstance(read, str):
        return read
    listed: dict[str, str] = {}
    for rank, manifest in sorted(read.items()):
        for name, value in manifest["files"].items():
            if name in listed:
                return f"{name} is listed by two ranks' manifests"
            listed[name] = value.lower()
    for name in data_files(directory):
        if name not in listed:
            return f"{name} is in no manifest: it was not written with this checkpoint"
    for name in listed:
        if not os.path.lexists(directory / name):
            return f"{name} is missing (its manifest lists it)"
    return sorted(listed.items())


def mismatch(path: Path, recorded: str) -> str | None:
    """Why ``path`` fails its checksum (``recorded``, the manifest's digest), or None when it matches."""
    sidecar = _sidecar(path)
    if not os.path.lexists(sidecar):
        return f"{path.name} has no {SUFFIX} checksum beside it"
    if not _regular(sidecar):
        return f"{sidecar.name} is not a regular file"
    if not _regular(path):
        return f"{path.name} is not a regular file"
    try:
        written = sidecar.read_text().split()[0]
    except (OSError, IndexError, UnicodeDecodeError):
        return f"{sidecar.name} is unreadable"
    if written.lower() != recorded:
        return f"{sidecar.name} does not name the digest its manifest lists"
    return None if digest(path) == recorded else f"{path.name} does not match the sha256 written with it"


def verify_file(directory: Path, name: str) -> str | None:
    """One file's checksum (``trainer_state.json``, read before the rest), the manifests checked first."""
    listed = _listed(directory)
    if isinstance(listed, str):
        return listed
    recorded = dict(listed).get(name)
    return f"{name} is in no manifest" if recorded is None else mismatch(directory / name, recorded)


def verify(directory: Path, rank: int, world_size: int) -> str | None:
    """The first thing wrong with the checkpoint's checksums, as found by any rank, or None.

    Every rank checks the manifests (a few small files); rank r hashes every W-th listed file from
    the r-th; one all-reduce tells every rank the first failure (a manifest's is first of all), so
    all of them refuse with the same words. With ``world_size > 1`` every rank must call it.
    """
    listed = _listed(directory)
    files = [] if isinstance(listed, str) else listed
    first = -1 if isinstance(listed, str) else len(files)
    for index in range(rank, len(files), world_size):
        if mismatch(directory / files[index][0], files[index][1]) is not None:
            first = index
            break
    if world_size > 1:  # the lowest failing index over ranks
        first = -int(comm.all_reduce_max(torch.tensor([-first], dtype=torch.int64))[0])
    if first == len(files):
        return None
    if first == -1:
        return listed if isinstance(listed, str) else "a manifest failed on another rank"
    name, recorded = files[first]
    return mismatch(directory / name, recorded) or f"{name} failed on another rank"
