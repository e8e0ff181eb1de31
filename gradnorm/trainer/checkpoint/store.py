"""Checkpoints: one directory per step, written by every rank at once, complete or absent.

Layout of output-dir/ (the same for ``--parallel ddp``, ``fsdp`` and a plain process):

    ckpt_step{N}/              the state after optimizer step N, complete
        .metadata              DCP's index of the tensors (written last by the coordinator)
        *.sha256               each file's checksum, written with it, checked before it is read
        manifest.rank{r}.json  rank r's files with their sha256 and the step: what binds each file
                               to this checkpoint (``gradnorm.trainer.checkpoint.checksums``)
        __{r}_0.distcp         rank r's part: its shards of the model and AdamW state under FSDP2
                               (under DDP DCP spreads the replicated tensors over the ranks), the
                               reference policy when --beta > 0, and rank r's RNG states
        trainer_state.json     the trainer's counters (RunState: step, warm-up record,
                               elapsed_s, skipped, in_a_row), plain JSON
    .ckpt_step{N}.tmp/         a checkpoint being written, never read

Atomic. ``save`` writes into ``.ckpt_step{N}.tmp``; once every rank has written its part and the
coordinator its ``.metadata``, rank 0 adds trainer_state.json, fsyncs it and renames the directory
to ``ckpt_step{N}``. A rename within one filesystem is atomic on POSIX, so a crash at any moment
(SIGKILL mid-write included) leaves the earlier checkpoints as they were and at most a ``.tmp``
directory, which ``latest_checkpoint`` ignores and the next save of that step replaces.

Failures. Each of the three phases (rank 0 makes the temporary directory; every rank writes; rank 0
publishes) ends with every rank agreeing that it worked (``comm.all_true``), so a full disk or a
permission error on any rank is the same ``CheckpointError`` on every rank, never a hang; the
temporary directory is removed and the earlier checkpoints stay.

Resharding. Tensors are stored by name with their global shape (``gradnorm.dist.state``), so a
checkpoint loads into any world size and either ``--parallel``: 2 FSDP2 ranks -> 1 plain process,
DDP -> FSDP2, and back.

Safe loading. Nothing in a checkpoint is ever unpickled without an allow-list: trainer_state.json is
JSON; ``.metadata`` goes through a restricted unpickler and tensors through
``torch.load(weights_only=True)`` (details in ``gradnorm.dist.state``). RNG states are tensors."""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from gradnorm.core.errors import first_line
from gradnorm.dist import comm
from gradnorm.dist import state as dist_state
from gradnorm.trainer.checkpoint import checksums
from gradnorm.trainer.checkpoint.rng import rng_state, set_rng_state

_NAME = re.compile(r"^ckpt_step(\d+)$")


RUN_FILE = "trainer_state.json"


ADVICE = "delete it to fall back on an earlier checkpoint (--resume, or python -m gradnorm.export --step N), or start afresh"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (full disk, permissions...); the earlier ones are intact."""


def described(error: BaseException, directory: str | Path) -> str:
    """``Type: first line`` of a failed write into ``directory``, naming a full disk as one: torch's
    writer says only "[enforce fail at inline_container.cc:...] unexpected pos", safetensors its own."""
    text = f"{type(error).__name__}: {first_line(error, 400)}"
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return text
    try:
        free = shutil.disk_usage(Path(directory) if Path(directory).exists() else Path(directory).parent).free
    except OSError:
        return text
    return text + (f"; no space left on device: {free} bytes free" if free < 1 << 20 else "")


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    """Where the checkpoint taken after optimizer step ``step`` lives."""
    return Path(output_dir) / f"ckpt_step{step}"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step in ``output_dir``, or None.

    Only a finished checkpoint has the name ``ckpt_step{N}`` (the rename is the last act of
    ``save``); a ``.ckpt_step{N}.tmp`` left by a crash is ignored.
    """
    found = [(int(m.group(1)), p) for p in Path(output_dir).glob("ckpt_step*") if (m := _NAME.match(p.name)) and p.is_dir()]
    return max(found)[1] if found else None


def save(output_dir: str | Path, step: int, state: dict[str, Any], run: dict[str, Any], rank: int) -> Path:
    """Write ``state`` (named tensors, ``dist.state.training_state``), this rank's RNG states and
    ``run`` (JSON, written by rank 0) as ``ckpt_step{step}``. Every rank must call it."""
    final, tmp = checkpoint_dir(output_dir, step), Path(output_dir) / f".ckpt_step{step}.tmp"
    world_size = comm.world_size()
    previous = latest_checkpoint(output_dir)
    state = {**state, "rng": {f"rank{rank}": rng_state()}}

    def fresh_tmp():  # rank 0: an empty temporary directory (a torn one from a crash goes)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)

    def publish():  # rank 0: the counters, its manifest, then the atomic rename
        if rank == 0:
            _write_synced(tmp / RUN_FILE, json.dumps(run, indent=2) + "\n")
            checksums.seal(tmp, 0, world_size, step, [*checksums.own_shards(tmp, 0), dist_state.METADATA_FILE, RUN_FILE])
            if final.exists():  # the same step saved again (a rerun): the new one replaces it
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(final.parent)

    def write_shards():  # every rank its part, then the checksums of what it wrote (rank 0's at publish)
        dist_state.write(state, tmp)
        if rank != 0:
            checksums.seal(tmp, rank, world_size, step, checksums.own_shards(tmp, rank))

    for phase in (fresh_tmp, write_shards, publish):
        error = None
        try:
            phase()
        except Exception as err:  # any rank's failure must reach every rank, or the others would hang
            error = err
        if not comm.all_true(error is None):
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            what = described(error, output_dir) if error is not None else "it failed on another rank"
            # the run's files stay (gradnorm.trainer.rundir): the way on is --resume, or --overwrite with nothing to resume
            fixed = "once the cause is fixed (disk space, permissions)"
            if previous:
                kept = f"the previous checkpoint {previous} is intact; {fixed}, --resume continues from it"
            else:
                kept = f"there is no earlier checkpoint; {fixed}, --overwrite starts the run again"
            raise CheckpointError(f"could not write checkpoint {final} ({what}); the temporary files are "
                                  f"removed and {kept}")
    return final


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename makes the checkpoint visible


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a power loss
    finally:
        os.close(fd)


def read_run_state(path: str | Path, required: tuple[str, ...]) -> dict[str, Any]:
    """trainer_state.json of a checkpoint: a one-line ValueError if absent, corrupt or incomplete."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} does not exist")
    try:
        run = json.loads((path / RUN_FILE).read_text())
    except FileNotFoundError:
        raise ValueError(f"checkpoint {path} is not a gradnorm trainer checkpoint (missing {RUN_FILE}); {ADVICE}") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"checkpoint {path} is truncated or corrupt ({RUN_FILE}: {first_line(err)}); {ADVICE}") from None
    if checksums.checked(path):
        _check_name(path, checksums.recorded_step(path), checksums.MANIFEST.format(rank=0))
        if why := checksums.verify_file(path, RUN_FILE):
            raise ValueError(f"checkpoint {path} is truncated or corrupt ({why}); {_advice(path)}")
    missing = [k for k in required if not isinstance(run, dict) or k not in run]
    if missing:
        raise ValueError(f"checkpoint {path} is not a gradnorm trainer checkpoint ({RUN_FILE} lacks "
                         f"{', '.join(missing)}); {ADVICE}")
    _check_name(path, run.get("step") if isinstance(run, dict) else None, RUN_FILE)  # a checkpoint before checksums too
    return run


def _step_of(path: Path) -> int | None:
    return int(m.group(1)) if (m := _NAME.match(path.name)) else None


def _check_name(path: Path, step, where: str) -> None:
    """A ValueError if the checkpoint's files say another step than its name (a directory renamed by
    hand): resumed, it would continue from its own step and save over the checkpoints after it."""
    named = _step_of(path)
    if named is None or type(step) is not int or step == named:
        return
    raise ValueError(f"checkpoint {path} holds step {step} ({where}), not step {named} as its name says: renamed "
                     f"by hand? Give it its name back (ckpt_step{step}) or delete it: resumed as it is, the run would "
                     f"continue from step {step} and save over the checkpoints after it")


def load(path: str | Path, state: dict[str, Any], rank: int) -> None:
    """Fill ``state``'s tensors in place from the checkpoint, resharded to this run, and restore
    this rank's RNG states (rank 0's when the checkpoint was written by fewer ranks)."""
    path = Path(path)
    stored = _stored_tensors(path)
    _check_same_model(path, stored, state)
    _verify(path, rank, comm.world_size())
    key = f"rank{rank}" if f"rng.rank{rank}.torch" in stored else "rank0"
    rng = {name: t for name, t in rng_state().items() if f"rng.{key}.{name}" in stored}  # CUDA only if saved
    try:
        dist_state.read({**state, "rng": {key: rng}}, path)
    except Exception as err:
        raise _load_error(path, err) from None
    set_rng_state(rng)


def read_tensors(path: str | Path, name: str = "model") -> dict[str, torch.Tensor]:
    """One part of a checkpoint (``model``, ``ref``...) as full CPU tensors, whatever wrote it.

    For tools (``gradnorm.export``) and tests, in a process without a process group.
    """
    path = Path(path)
    prefix = name + "."
    part = {key[len(prefix):]: torch.empty(shape, dtype=dtype)
            for key, (shape, dtype) in _stored_tensors(path).items() if key.startswith(prefix)}
    if not part:
        raise ValueError(f"checkpoint {path} holds no {name} tensors; {ADVICE}")
    _verify(path, rank=0, world_size=1)
    try:
        dist_state.read({name: part}, path)
    except Exception as err:
        raise _load_error(path, err) from None
    return part


def _verify(path: Path, rank: int, world_size: int) -> None:
    """Every file's checksum, split between the ranks, and the step the manifests bind the files to
    against the directory's name (a checkpoint written before checksums: none of it)."""
    if not checksums.checked(path):
        return
    _check_name(path, checksums.recorded_step(path), checksums.MANIFEST.format(rank=0))  # same files, every rank
    if why := checksums.verify(path, rank, world_size):
        raise ValueError(f"checkpoint {path} is truncated or corrupt ({why}); {_advice(path)}")


def _advice(path: Path) -> str:
    """ADVICE, naming the complete checkpoint before ``path`` when there is one."""
    earlier = [(int(m.group(1)), p) for p in path.parent.glob("ckpt_step*")
               if (m := _NAME.match(p.name)) and p.is_dir() and p != path]
    step = int(_NAME.match(path.name).group(1)) if _NAME.match(path.name) else None
    before = max((e for e in earlier if step is None or e[0] < step), default=None)
    return f"{ADVICE} (the checkpoint before it: {before[1].name})" if before else ADVICE


def _stored_tensors(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} does not exist")
    try:
        metadata = dist_state.read_metadata(path)
    except dist_state.RefusedPickle as err:
        raise ValueError(f"checkpoint {path} is refused by the safe unpickler of its {dist_state.METADATA_FILE}: "
                         f"{err}, so it is not a gradnorm checkpoint and may be malicious; {ADVICE}") from None
    except Exception as err:  # EOFError, "invalid load key"...: not a refusal, broken bytes
        raise ValueError(f"checkpoint {path} is truncated or corrupt ({dist_state.METADATA_FILE}: "
                         f"{type(err).__name__}: {first_line(err)}); {ADVICE}") from None
    stored = dist_state.stored_tensors(metadata)
    if "rng.rank0.torch" not in stored:
        raise ValueError(f"checkpoint {path} is not a gradnorm trainer checkpoint (no RNG states); {ADVICE}")
    return stored


def _check_same_model(path: Path, stored: dict, state: dict) -> None:
    expected = dict(dist_state.tensor_leaves(state))  # DTensors report their global shape
    problem = None
    for key, tensor in expected.items():
        if key.startswith("ref.") and key not in stored:
            raise ValueError(f"checkpoint {path} holds no reference policy (it was written with --beta 0); "
                             "resume with --beta 0")
        if key not in stored:
            problem = f"it lacks {key}"
        elif stored[key][0] != tuple(tensor.shape):
            problem = f"{key} is {list(stored[key][0])} there, {list(tensor.shape)} here"
        if problem:
            break
    extra = [k for k in stored if k.startswith("model.") and k not in expected]
    problem = problem or (f"it has {extra[0]}, which this model lacks" if extra else None)
    if problem:
        raise ValueError(f"checkpoint {path} holds a different model ({problem}); "
                         "resume with the --model (--n-layer/--n-head/--n-embd) it was trained with")


def _load_error(path: Path, err: BaseException) -> ValueError:
    if isinstance(err, pickle.UnpicklingError):  # torch.load(weights_only=True) refused a tensor payload
        found = re.search(r"unsupported (?:global: )?GLOBAL (\S+)", str(err), re.I)
        what = f"it references {found.group(1)}" if found else "it holds more than tensors"
        # never repeat torch's message, which suggests weights_only=False
        return ValueError(f"checkpoint {path} is refused by the safe unpickler (weights_only=True): {what}, so it "
                          f"is not a gradnorm checkpoint and may be malicious; {ADVICE}")
    return ValueError(f"checkpoint {path} is truncated or corrupt ({type(err).__name__}: {first_line(err)}); {ADVICE}")
