"""What stops a run cleanly: checks before anything is built, one line for every failure, and
preemption by SIGTERM or Ctrl-C.

Failures
--------

How a run that cannot start or cannot go on says so: one ``error:`` line, from rank 0 first.

Exit codes: 2 for bad input found before anything is built (flags, files, directories, the
environment, memory), 1 for a run that failed while running (a checkpoint, a reward function, a
non-finite policy, out of memory). Under torchrun the job's exit code is torchrun's (1), and
torchrun prints its own report of the failed workers after our line.

Preemption
----------

Preemption: on SIGTERM or SIGINT every rank finishes its optimizer step, checkpoints and exits.

Clusters stop jobs with SIGTERM (SLURM, Kubernetes, and torchrun's agent, which forwards the
signal it gets to every worker), and people press Ctrl-C. Without this module either one would
lose every step since the last ``--save-every`` checkpoint, and Ctrl-C would print a traceback.

How a stop goes (the trainer uses this module in four lines):

 1. ``catch_signals()`` (around ``main()``) installs handlers for SIGTERM and SIGINT. The first
    signal only records a stop request; the step in flight goes on undisturbed, so no collective is
    ever cut in half and no rank is left waiting in one.
 2. At the end of every step each rank appends its request, ``votes(...)``, to the statistics
    that the trainer's logging all-reduce sums anyway (step 4): the ranks agree at no extra
    collective, even when only one of them got the signal. ``agreed(summed_votes)`` reads the
    sum, identical on every rank, so every rank takes the same decision.
 3. The trainer writes a checkpoint (atomically, with its ``save_checkpoint``) and raises
    ``Stopped``; ``main`` prints one line and exits with ``128 + signal``: **143 for SIGTERM, 130
    for SIGINT**, the shell's convention for "ended by this signal". A script can thus tell a run
    that stopped cleanly (continue it with ``--resume``) from one that finished (0) or failed (1, 2).
 4. A second signal exits at once, with the same code, one line and no checkpoint: the way out of a
    step that hangs. A copy of the first signal that arrives within ``DUPLICATE_S`` of it counts as
    the same request, because one stop can reach a worker twice (SLURM signals every process of a
    job while torchrun forwards the same signal to its workers).

The second signal is acted on by a watcher thread that reads the signal wakeup fd: CPython runs a
Python-level handler only when the main thread executes bytecode, which it does not while it
waits inside a collective on a dead peer. The thread sees every signal as soon as it arrives.

Preflight
---------

Checks of everything outside the flags, before any process group or model exists.

Each check raises a one-line ValueError naming the flag or file and what to do; main() prints it
as ``error: ...`` and exits with 2. They only read (the output directory gets a test file that is
removed at once), so every rank runs them and reaches the same verdict.

- the launch environment: torchrun's variables all set, or none (a stale shell exports some);
- ``--output-dir``: creatable and writable (not a file, not under a file, not in /proc, /sys, /dev);
- ``--prompts``: a readable JSONL file of prompts and answers;
- ``--model``: a local directory with a readable config.json and intact weights, or a Hub name
  (the rule in ``is_local_model``);
- ``--reward``: importable, callable as reward(response, answer);
- ``--export-hf``: a directory the end-of-run export may write or replace (``gradnorm.trainer.outpaths``),
  so a bad one is refused before any training rather than after it;
- ``--report-to``: each logger's package imports, and its directory in output-dir is writable.

Memory
------

Will a configuration fit? The largest tensors of a step against the memory the device has free.

Refusing at once beats an out-of-memory error (or the kernel's OOM killer) an hour into the first
rollout. The estimate is the worst case a run must survive, every response ``max-new-tokens``
long (a policy may produce that at any step), and it counts only the largest tensors, per rank:

    static   = 16 N bytes: fp32 weights, gradients and AdamW's two moments (divided by W under
               FSDP), plus 4 N for the frozen reference when beta > 0
    rollout  = KV cache 2 L S_roll (P + R) d_kv b  +  prefill logits S_roll P V b
               (+ the whole rollout scored under no_grad, S_roll R V (b + 4) bytes, when old or
               reference log-probs are needed); every rank samples the whole rollout batch, so
               S_roll = prompts-per-step * minibatches-per-rollout * group-size, whatever W
    training = a microbatch's logits mb R V (b + 4 + 4) (logits, fp32 log-softmax, its gradient)
               + activations L mb (P + R) d b c, c = 4 tensors of width d per layer (1 with
               gradient checkpointing); mb = S / (W A)
    eval     = the rollout's KV cache and prefill logits for S_eval = --eval-prompts sequences
    warmup   = (built-in model) B (P + R) V (b + 8) + 4 L B (P + R) d b, B = --warmup-batch
    peak     = static + max(rollout, training, eval, warmup)

with b = 2 bytes under bf16 autocast, else 4. A Hub id's shape is unknown before it downloads: no
estimate.

A Hugging Face model's prompt length P, the longest prompt of --prompts in tokens, is known only once
its tokenizer has run. The preflight takes P = 1 (a lower bound: what it refuses, no prompt makes
fit); ``build_policy`` checks again with the real P, between the tokenizer and the weights
(``check_prompt_length``), together with the model's context: P + max-new-tokens must not exceed what
its config states. Tokenizing at preflight would tokenize every prompt twice, and a Hub id's
tokenizer is not there before it downloads.
"""

from __future__ import annotations

import errno
import signal
import sys
import time
from types import CodeType
import torch
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from torch import Tensor
import importlib
import importlib.util
import json
import re
import tempfile
from gradnorm.core.errors import first_line  # also what main() reports a failed join with
from gradnorm.tasks.prompts import load_prompts
from gradnorm.tasks.rewards import get_reward
from gradnorm.trainer.config import TrainConfig
from gradnorm.trainer.outpaths import check_export_dir
import math
from gradnorm.tasks import RepeatTask
from gradnorm.models import hf
from gradnorm.models.tinygpt import GPTConfig, TinyGPT


# ------------------------------------------------------------------ How a run that cannot start or cannot go

GRACE_S = 30.0
"""How long a rank other than 0 waits before printing an error of its own (``report_error``)."""

MEMORY_ADVICE = ("raise --grad-accum-steps or the number of ranks, lower --prompts-per-step, --group-size or "
                 "--max-new-tokens, or (a Hugging Face model) add --gradient-checkpointing or --parallel fsdp")


class InputError(ValueError):
    """Bad input found only once the model or its tokenizer is loaded (the prompt length a budget must
    hold, a model that cannot take packed rows): reported like a preflight error, exit code 2."""


def report_error(message: str, rank: int) -> None:
    """Print ``error: message`` on stderr, rank 0 first.

    Under torchrun every rank finds the same bad input, and torchrun stops the whole job as soon
    as one worker exits: a rank that exited first could get rank 0 killed before it printed. So
    rank 0 prints and exits at once, and the others wait up to GRACE_S, with SIGTERM's default
    action restored so that torchrun's stop ends the wait, and print only if nobody stopped them:
    an error that rank 0 did not find, prefixed with their rank.
    """
    if rank != 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(GRACE_S)
        message = f"rank {rank}: {message}"
    print(f"error: {message}", file=sys.stderr, flush=True)


def failed_step(err: BaseException, loop: CodeType) -> int | None:
    """The value of ``step`` in the frame running ``loop`` (train()'s code) when ``err`` was raised.

    Read from the traceback, so the training loop needs no bookkeeping for errors; None before
    the loop's first step (building, loading, the warm-up).
    """
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is loop:
            step = tb.tb_frame.f_locals.get("step")
            return step if isinstance(step, int) else None
        tb = tb.tb_next
    return None


def out_of_memory(err: BaseException) -> bool:
    """CUDA's or Python's out-of-memory error, or torch's CPU allocator failing (a plain RuntimeError)."""
    return isinstance(err, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(err, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(err))


def explain(err: BaseException, device: torch.device, step: int | None) -> str:
    """The message of an error that stopped a run at ``step`` (None: before the first step)."""
    where = "" if step is None else f"step {step}: "
    if out_of_memory(err):
        first = first_line(err, 160)
        return f"{where}out of memory on {device} ({first}); {MEMORY_ADVICE}; the checkpoints written so far are intact"
    return where + str(err)


def peer_failure(posted: dict[int, str], err: BaseException, rank: int, world_size: int, timeout_s: float,
                 step: int | None) -> str:
    """The message of a collective that failed on this rank because of a peer.

    ``posted`` holds the errors failing ranks left (``comm.post_error``): the lowest other rank's
    is the cause. Without one the peer died (SIGKILL, a crash in C++) or hangs: say which rank
    when W = 2, and how long it was waited for.
    """
    others = {r: message for r, message in posted.items() if r != rank}
    if others:
        first = min(others)
        return f"rank {first}: {others[first]}"
    where = "" if step is None else f"step {step}: "
    who = f"rank {1 - rank}" if world_size == 2 else "another rank"
    text = first_line(err, 300)
    why = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". This is typically")[0]  # gloo's source location and advice out
    if "Timed out" in text or "timed out" in text.lower():
        return (f"{where}{who} stopped responding after {timeout_s:g} s (--timeout-s) in a collective ({why}); its "
                "own output says why, or it hangs; raise --timeout-s if one of its steps may take that long")
    return f"{where}{who} died or left the process group ({why}); its own output, or the launcher's, says why"


# ------------------------------------------------------------------ Preemption: on SIGTERM or SIGINT every ra

SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals that stop a run; ``votes`` has one entry per signal, in this order."""
NUM_VOTES = len(SIGNALS)
DUPLICATE_S = 1.0
"""A repeat of the first signal within this many seconds is the same stop request, not a second one."""


class Stopped(Exception):
    """Raised by the trainer after the checkpoint of the step at which the ranks agreed to stop."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        self.signum, self.step, self.checkpoint = signal.Signals(signum), step, checkpoint
        if checkpoint is None:  # the first step of an --overwrite run: nothing of it is kept
            super().__init__(f"stopped by {self.signum.name} after step {step}, the first of this --overwrite run: "
                             "no checkpoint written, so the run it replaced is kept (put back in --output-dir)")
            return
        super().__init__(f"stopped by {self.signum.name} after step {step}: checkpoint {checkpoint} written; "
                         "continue with --resume")

    @property
    def exit_code(self) -> int:
        """128 + the signal number: 143 for SIGTERM, 130 for SIGINT."""
        return 128 + int(self.signum)


class _Requests:
    """What this process has received; written by the watcher thread, read by the main thread."""

    def __init__(self):
        self.first: signal.Signals | None = None
        self.first_at = 0.0

    def receive(self, signum: signal.Signals) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first, self.first_at = signum, now
            _say(f"received {signum.name}: finishing this step, then checkpoint and exit "
                 f"(send it again to exit at once, without a checkpoint)", rank0_only=True)
        elif now - self.first_at > DUPLICATE_S:
            _say(f"received {signum.name} again: exiting at once, without a checkpoint (exit code {128 + signum})")
            os._exit(128 + int(signum))


_requests = _Requests()


def _say(message: str, rank0_only: bool = False) -> None:
    # os.write, not print: this runs on the watcher thread while the main thread may be printing.
    rank = os.environ.get("RANK", "0")
    if rank0_only and rank != "0":
        return
    prefix = f"rank {rank}: " if "RANK" in os.environ and rank != "0" else ""
    os.write(2, f"{prefix}{message}\n".encode())


def _watch(read_fd: int) -> None:
    while data := os.read(read_fd, 64):  # b"" once catch_signals closes the write end
        for signum in data:
            if signum in SIGNALS:
                _requests.receive(signal.Signals(signum))


def _noted(signum, frame) -> None:
    """The Python-level handler: nothing to do, the watcher thread has already seen the signal."""


@contextmanager
def catch_signals() -> Iterator[None]:
    """Within the block, SIGTERM and SIGINT request a stop instead of ending the process.

    Restores the previous handlers (and forgets any request) on the way out. Outside the main
    thread, where Python cannot install handlers, it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # the C-level handler must never block on a full pipe
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    previous = {signum: signal.signal(signum, _noted) for signum in SIGNALS}
    watcher = threading.Thread(target=_watch, args=(read_fd,), name="gradnorm-preemption", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(previous_fd)
        os.close(write_fd)
        watcher.join(timeout=5)
        os.close(read_fd)
        _requests.__init__()


def requested() -> signal.Signals | None:
    """The first stop signal this process received inside ``catch_signals``, if any."""
    return _requests.first


def votes(like: Tensor) -> Tensor:
    """This rank's stop votes (NUM_VOTES,), float64 on ``like``'s device: 1 for the signal received."""
    return torch.tensor([float(_requests.first == s) for s in SIGNALS], dtype=torch.float64, device=like.device)


def agreed(summed_votes: Tensor) -> signal.Signals | None:
    """The signal every rank stops for, from the votes summed over ranks; None to go on.

    SIGTERM wins over SIGINT when ranks got different ones (a scheduler's stop is not negotiable).
    """
    for signum, count in reversed(list(zip(SIGNALS, summed_votes.tolist()))):
        if count > 0:
            return signum
    return None


# ------------------------------------------------------------------ Checks of everything outside the flags, b

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
VIRTUAL_FILESYSTEMS = ("/proc", "/sys", "/dev")


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
    return rank, world_size


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
    kind = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    local = environ.get("LOCAL_RANK", "0")
    return torch.device("cuda", int(local) if local.isdigit() else 0) if kind == "cuda" else torch.device("cpu")


def check_output_dir(path: str) -> None:
    """--output-dir exists as a writable directory, or can be created (nothing is left behind)."""
    absolute = Path(os.path.abspath(path))
    _check_resolvable(path, absolute)
    for root in VIRTUAL_FILESYSTEMS:
        if absolute == Path(root) or Path(root) in absolute.parents:
            raise ValueError(f"--output-dir {path} is under {root}, a virtual filesystem; choose a directory on disk")
    if absolute.exists() and not absolute.is_dir():
        raise ValueError(f"--output-dir {path} is a file, not a directory")
    probe = absolute
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"--output-dir {path} cannot be created: {probe} is a file")
    try:  # the one reliable test of writability (os.access is wrong for root, ACLs and read-only mounts)
        fd, tmp = tempfile.mkstemp(dir=probe, prefix=".gradnorm-write-test-")
        os.close(fd)
        os.unlink(tmp)
    except OSError as err:
        what = "" if probe == absolute else f" (its nearest existing parent {probe})"
        raise ValueError(f"--output-dir {path}{what} is not writable: {err.strerror}") from None


def _check_resolvable(path: str, absolute: Path) -> None:
    """Every component fits the filesystem's name limit, and none is a dangling symlink or a loop."""
    existing = next(p for p in [absolute, *absolute.parents] if os.path.isdir(p))
    try:
        name_max = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    for part in absolute.parts:
        if len(os.fsencode(part)) > name_max:
            raise ValueError(f"--output-dir {path}: the name {part[:20]}... is {len(os.fsencode(part))} bytes long, "
                             f"more than this filesystem allows ({name_max}); choose a shorter name")
    for p in [absolute, *absolute.parents]:
        if os.path.islink(p):
            try:
                os.stat(p)
            except OSError as err:
                what = "a symlink loop" if err.errno == errno.ELOOP else f"a dangling symlink (to {os.readlink(p)})"
                where = "is" if p == absolute else f"cannot be created: {p} is"
                raise ValueError(f"--output-dir {path} {where} {what}; fix or remove the link, or choose "
                                 "another --output-dir") from None


def check_prompts(path: str) -> None:
    try:
        load_prompts(path)
    except (OSError, ValueError) as err:  # missing, a directory, unreadable, not UTF-8, not JSONL
        raise ValueError(f"--prompts: {first_line(err)}") from None


# A Hub model id: name, or org/name (letters, digits, - _ .).
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def is_local_model(name: str) -> bool:
    """The rule for --model: a local directory if the path exists, starts with / ./ ../ or ~, has
    more than one /, or its first component is an existing directory here (``runs/tiny-llama``
    with ``runs/`` present); otherwise a Hugging Face Hub id (``gpt2``, ``Qwen/Qwen2.5-0.5B``)."""
    path = Path(name).expanduser()
    if path.exists() or name.startswith(("/", "./", "../", "~")) or name in (".", ".."):
        return True
    parts = name.split("/")
    return len(parts) > 2 or (len(parts) == 2 and Path(parts[0]).is_dir())


def check_model(name: str) -> None:
    """A local model directory is complete and readable; a Hub id is well-formed (and cached when offline)."""
    if importlib.util.find_spec("transformers") is None:
        raise ValueError("a Hugging Face --model needs transformers: pip install -e '.[hf]'")
    if not is_local_model(name):
        if not HUB_ID.match(name):
            raise ValueError(f"--model {name!r} is neither an existing directory nor a Hub id (name or org/name)")
        _check_cached_when_offline(name)
        return
    path = Path(name).expanduser()
    if not path.is_dir():
        what = "not a directory" if path.exists() else "no such directory"
        raise ValueError(f"--model {name}: {what} (a local model is a save_pretrained directory)")
    config = path / "config.json"
    try:
        if not isinstance(json.loads(config.read_text()), dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:
        why = "missing" if not config.exists() else f"unreadable: {getattr(err, 'strerror', None) or err}"
        raise ValueError(f"--model {name}: {config} is {why} (a local model is a save_pretrained directory)") from None
    weights = sorted(path.glob("*.safetensors")) + sorted(path.glob("pytorch_model*.bin"))
    if not weights:
        raise ValueError(f"--model {name}: no weights (*.safetensors or pytorch_model*.bin) in {path}")
    for file in weights:
        if file.suffix == ".safetensors":
            safetensors_params(file)
        else:
            try:
                with open(file, "rb") as f:
                    f.read(1)
            except OSError as err:
                raise ValueError(f"--model {name}: {file} is unreadable ({err.strerror})") from None


def safetensors_params(path: Path) -> int:
    """The number of parameters in a .safetensors file, from its header; a one-line ValueError if the
    file is truncated or corrupt (the header must describe exactly the bytes that follow it)."""
    bad = f"--model: {path} is truncated or corrupt"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or not 2 <= n <= size - 8:
                raise ValueError(f"{bad} (its header length does not fit the file); download or save it again")
            header = json.loads(f.read(n))
    except OSError as err:
        raise ValueError(f"--model: {path} is unreadable ({err.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{bad} (its header is not JSON); download or save it again") from None
    try:
        tensors = [v for k, v in header.items() if k != "__metadata__"]
        end = max((int(t["data_offsets"][1]) for t in tensors), default=0)
        params = sum(_numel(t["shape"]) for t in tensors)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError):
        raise ValueError(f"{bad} (its header is not a safetensors header); download or save it again") from None
    if 8 + n + end != size:
        raise ValueError(f"{bad} ({size} bytes, its header describes {8 + n + end}); download or save it again")
    return params


def _numel(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count


def _check_cached_when_offline(name: str) -> None:
    # Online, a Hub id is checked when it loads (one line if it is not found). Offline, a missing
    # download is known now, instead of after the loader's retries.
    offline = any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    if not offline:
        return
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(name, "config.json"), str):
        raise ValueError(f"--model {name}: not in the local Hugging Face cache, and HF_HUB_OFFLINE is set; "
                         "download it first, or give a local directory")


def check_inputs(cfg: TrainConfig) -> None:
    """Every file and directory the flags name: the real model's inputs, then the output directory."""
    if not cfg.builtin:
        check_model(cfg.model)
        check_prompts(cfg.prompts)
        get_reward(cfg.reward)
    check_output_dir(cfg.output_dir)
    if cfg.export_dir is not None:
        check_export_dir(cfg.export_dir, cfg.output_dir, flag="--export-hf")
    check_reporters(cfg)


REPORTER_MODULES = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb"}
"""What each name of --report-to imports (its directory is output-dir/<name>)."""


def check_reporters(cfg: TrainConfig) -> None:
    """--report-to: each logger imports, and its directory output-dir/<name> can be written.

    The import is real, not a lookup: a package that is there but broken (a protobuf that does
    not fit it, the usual way tensorboard and wandb break) fails here, not after the warm-up.
    """
    for name in cfg.reporters:
        module = REPORTER_MODULES[name]
        try:
            importlib.import_module(module)
        except Exception as err:  # ImportError, or whatever a broken install raises on import
            raise ValueError(f"--report-to {name}: cannot import {module} ({first_line(err)}); "
                             f"pip install -e '.[report]', or leave {name} out of --report-to") from None
        try:
            check_output_dir(str(Path(cfg.output_dir) / name))
        except ValueError as err:  # its message names --output-dir; here the directory is the logger's
            raise ValueError(f"--report-to {name}: {str(err).replace('--output-dir ', 'log directory ', 1)}") from None


# ------------------------------------------------------------------ Will a configuration fit? The largest ten

GiB = 2**30


def model_shape(cfg: TrainConfig, prompt_len: int | None = None) -> dict | None:
    """{params, n_layer, width, kv_width, vocab, prompt_len} of the policy, or None when unknown.

    ``prompt_len``: a Hugging Face model's P, the longest prompt of --prompts in tokens; 1 when not
    given (the preflight, before the tokenizer has run).
    """
    if cfg.builtin:
        task = RepeatTask(max_new_tokens=cfg.max_new_tokens)
        with torch.device("meta"):  # shapes only, no memory
            model = TinyGPT(GPTConfig(task.vocab_size, task.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd))
        return {"params": sum(p.numel() for p in model.parameters()), "n_layer": cfg.n_layer, "width": cfg.n_embd,
                "kv_width": cfg.n_embd, "vocab": task.vocab_size, "prompt_len": task.prompt_len}
    path = Path(cfg.model).expanduser()
    if not (is_local_model(cfg.model) and (path / "config.json").is_file()):
        return None
    config = json.loads((path / "config.json").read_text())
    config = config.get("text_config", config)  # a multimodal model's language model
    # the names most configs use, then GPT-2's (n_embd, n_layer, n_head) and T5-style ones
    width, layers, heads = (next((config[k] for k in names if config.get(k)), None) for names in (
        ("hidden_size", "n_embd", "d_model"), ("num_hidden_layers", "n_layer", "num_layers"),
        ("num_attention_heads", "n_head", "num_heads")))
    vocab = config.get("vocab_size")
    if not all(isinstance(v, int) and v > 0 for v in (width, layers, vocab, heads)):
        return None
    head_dim = config.get("head_dim") or width // heads
    return {"params": sum(safetensors_params(f) for f in path.glob("*.safetensors")), "n_layer": layers,
            "width": width, "kv_width": (config.get("num_key_value_heads") or heads) * head_dim, "vocab": vocab,
            "prompt_len": 1 if prompt_len is None else prompt_len}


def estimate(cfg: TrainConfig, shape: dict, world_size: int, device_type: str) -> dict[str, int]:
    """Bytes per rank of the three parts of the module docstring: static, rollout, training."""
    b = 2 if cfg.autocast_dtype(device_type) is not None else 4
    N, L, d, d_kv, V, P = (shape[k] for k in ("params", "n_layer", "width", "kv_width", "vocab", "prompt_len"))
    R = cfg.max_new_tokens
    S_roll = cfg.prompts_per_step * cfg.minibatches_per_rollout * cfg.group_size
    mb = math.ceil(cfg.sequences_per_step / (world_size * cfg.grad_accum_steps))
    rescored = cfg.updates_per_rollout > 1 or cfg.beta > 0
    S_eval, B_warm, T = cfg.eval_prompts, cfg.warmup_batch if cfg.builtin else 0, P + R
    return {
        "static": 16 * N // (world_size if cfg.parallel == "fsdp" else 1) + (4 * N if cfg.beta > 0 else 0),
        "rollout": 2 * L * S_roll * (P + R) * d_kv * b + S_roll * P * V * b + (S_roll * R * V * (b + 4) if rescored else 0),
        "training": mb * R * V * (b + 8) + L * mb * (P + R) * d * b * (1 if cfg.gradient_checkpointing else 4),
        # the reward before and after the warm-up: one response for each of --eval-prompts, on every rank
        "eval": 2 * L * S_eval * T * d_kv * b + S_eval * P * V * b,
        # the built-in model's supervised warm-up: whole sequences, logits with their log-softmax and gradient
        "warmup": B_warm * T * V * (b + 8) + 4 * L * B_warm * T * d * b,
    }


def available(device: torch.device) -> int:
    """Bytes free on ``device``: CUDA's free memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        import psutil

        return psutil.virtual_memory().available
    except ImportError:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024


ADVICE = {
    "static": "the weights, gradients and AdamW state alone need that: --parallel fsdp over more GPUs, or a smaller --model",
    "rollout": "every rank samples the whole rollout batch: lower --prompts-per-step, --group-size, "
               "--minibatches-per-rollout or --max-new-tokens",
    "training": "raise --grad-accum-steps or the number of ranks, lower --max-new-tokens, or (a Hugging Face "
                "model) add --gradient-checkpointing",
    "eval": "every rank samples one response per evaluation prompt: lower --eval-prompts or --max-new-tokens",
    "warmup": "the warm-up trains on whole sequences in one batch: lower --warmup-batch",
}
WHAT = {"eval": "--eval-prompts {cfg.eval_prompts}", "warmup": "--warmup-batch {cfg.warmup_batch}"}
"""The flags behind a part of the estimate, for its error line (the rest: the batch of a step)."""


def check_fits(cfg: TrainConfig, world_size: int, device: torch.device, sharing: int = 1,
               prompt_len: int | None = None) -> None:
    """A one-line ValueError when the estimate exceeds the free memory; ``sharing`` ranks share a host's RAM.

    ``prompt_len``: a Hugging Face model's longest prompt in tokens, once known (``model_shape``).
    """
    shape = model_shape(cfg, prompt_len)
    if shape is None:
        return
    parts = estimate(cfg, shape, world_size, device.type)
    need = parts["static"] + max(v for k, v in parts.items() if k != "static")
    free = available(device) // (sharing if device.type == "cpu" else 1)
    if need <= free:
        return
    worst = max(parts, key=parts.get)
    flags = WHAT.get(worst, "--prompts-per-step {cfg.prompts_per_step} x --group-size {cfg.group_size}").format(cfg=cfg)
    if prompt_len is not None and worst != "static":
        flags += f", prompts of up to {prompt_len} tokens"
    raise ValueError(f"this configuration needs at least {size(need)} per rank on {device} ({worst} "
                     f"{size(parts[worst])}: {flags}, --max-new-tokens {cfg.max_new_tokens}), but {size(free)} are free; "
                     f"{ADVICE[worst]}")


def check_prompt_length(cfg: TrainConfig, prompt_len: int, world_size: int, device: torch.device,
                        sharing: int = 1) -> None:
    """What a Hugging Face run's longest prompt must pass once its tokenizer has run, before its weights
    load: the model's context (``check_context``), then the memory estimate at that prompt length.

    ``prompt_len``: the longest prompt of --prompts in tokens (``PromptTask.prompt_len``). Each failure
    is an ``InputError``, exit code 2 like the preflight's.
    """
    check_context(cfg, prompt_len)
    try:
        check_fits(cfg, world_size, device, sharing, prompt_len)
    except ValueError as err:
        raise InputError(str(err)) from None


def check_context(cfg: TrainConfig, prompt_len: int) -> None:
    """An ``InputError`` when prompt + --max-new-tokens exceeds the context the model's config states.

    Past it, a model with a table of learned positions (GPT-2) fails with an IndexError traceback as
    soon as it samples, and a rotary one (Llama) runs on, on positions it never saw. A config that
    states no context (``hf.context_length``) passes.
    """
    found = hf.context_length(cfg.model)
    if found is None:
        return
    field, context = found
    longest = prompt_len + cfg.max_new_tokens
    if longest <= context:
        return
    fix = (f"lower --max-new-tokens to {context - prompt_len} or less, or shorten the longest prompts"
           if prompt_len < context else
           "the prompt alone leaves no room for a response: shorten the longest prompts, or choose a model with a "
           "longer context")
    raise InputError(f"a sequence reaches {longest} tokens (the longest prompt of {cfg.prompts}, {prompt_len} tokens, "
                     f"+ --max-new-tokens {cfg.max_new_tokens}), more than --model {cfg.model} takes ({context}, "
                     f"{field} in its config); {fix}")


def size(n: int) -> str:
    """Bytes in the largest binary unit that leaves a number >= 1: 1.5 GiB, 12.0 KiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


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
