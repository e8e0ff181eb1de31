"""Running a real trainer on the probe: one launch per configuration, real processes, nothing left behind.

A configuration (W, A) runs the user's build function in ``gradnorm.audit.trainer.worker`` processes:
one plain process for W = 1, ``torchrun --standalone --nproc_per_node W`` otherwise (gloo on CPU,
NCCL on GPUs, as the trainer chooses). A script runs as the user typed it, with the probe's paths
where its placeholders are, the audit's own environment's ``bin/`` first on PATH (its ``python``
and ``torchrun``, as if activated), and this package's ``site/`` first on PYTHONPATH, whose
``sitecustomize`` installs the recorder in every Python process of the command. Either way each
rank writes ``rank<R>.pt`` at its first optimizer step, into a folder of the audit's temporary
directory; ``records`` reads them back.

A launch that fails, hangs past ``timeout`` (its whole process group is killed) or writes no
record is a ``TrainerError``, one line that says what to change.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

PLACEHOLDERS = ("{model}", "{data}", "{output_dir}")
SITE = Path(__file__).with_name("site")


class TrainerError(RuntimeError):
    """The trainer could not be audited; ``str()`` is the one line to print."""


@dataclass(frozen=True)
class Configuration:
    """One way to run the trainer: W ranks, A accumulation steps, ``per_device_batch`` units per microbatch."""

    world_size: int
    accum_steps: int
    per_device_batch: int

    @property
    def label(self) -> str:
        """The report's name for it: W and A have columns of their own."""
        return f"batch {self.per_device_batch}"

    @property
    def title(self) -> str:
        return f"W={self.world_size} A={self.accum_steps} batch={self.per_device_batch}"


def _env(out: Path, vocab_size: int, site: bool) -> dict[str, str]:
    env = dict(os.environ, GRADNORM_PROBE_OUT=str(out), GRADNORM_PROBE_VOCAB=str(vocab_size), OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", WANDB_MODE="disabled",
               # caches a trainer's imports write (datasets', torch's compiler's) stay in the audit's folder
               HF_DATASETS_CACHE=str(out / "cache" / "datasets"), TORCHINDUCTOR_CACHE_DIR=str(out / "cache" / "inductor"),
               TRITON_CACHE_DIR=str(out / "cache" / "triton"))
    if site:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), env.get("PYTHONPATH", "")) if p)
        # the command's `python` and `torchrun` are this environment's, as if it were activated: the one whose
        # gradnorm the recorder imports
        env["PATH"] = os.pathsep.join(p for p in (str(Path(sys.executable).parent), env.get("PATH", "")) if p)
    return env


def _run(argv: list[str], env: dict, out: Path, timeout: float, what: str, cwd: Path | None = None) -> None:
    """Run ``argv`` in its own process group (in ``cwd``); on a timeout kill the whole group."""
    log = out / "output.log"
    out.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as sink:
        proc = subprocess.Popen(argv, env=env, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=cwd)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise TrainerError(f"{what} ran past --timeout {timeout:g} s and was stopped: does it hang, or need "
                               "more time (raise --timeout)?") from None
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    errors = sorted(out.glob("error.rank*.txt"))
    if errors:
        rank = errors[0].name.removeprefix("error.rank").removesuffix(".txt")
        raise TrainerError(f"{what} failed on rank {rank}: {errors[0].read_text().strip()}")
    if code != 0 and not list(out.glob("rank*.pt")):
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:] or [""]
        raise TrainerError(f"{what} exited with status {code} before an optimizer step: {tail[0].strip()[:300]} "
                           f"(the whole output: {log})")


def records(out: Path, what: str) -> list[dict]:
    """The ranks' records of one launch, in rank order; a launch that stepped on no rank is a TrainerError."""
    found = {int(p.name[4:-3]): torch.load(p, weights_only=True) for p in out.glob("rank*.pt")}
    if not found:
        raise TrainerError(f"{what} ended without an optimizer step on any rank: does it train (a data set of the "
                           "probe's size, at least one optimizer step)?")
    world = found[min(found)]["world_size"]
    missing = sorted(set(range(world)) - set(found))
    if missing:
        raise TrainerError(f"{what}: rank {missing[0]} of {world} never reached an optimizer step")
    return [found[r] for r in range(world)]


def run_build(build: str, config: Configuration, model_path: Path, data_path: Path, vocab_size: int, out: Path,
              timeout: float) -> list[dict]:
    """Train the trainer ``build`` returns under ``config``; the ranks' records.

    The launch runs in ``out``, so that whatever the trainer writes to its working directory stays in
    the audit's folder; a build named by a relative file path is made absolute first.
    """
    where, sep, name = build.rpartition(":")
    if sep and (where.endswith(".py") or "/" in where) and Path(where).is_file():
        build = f"{Path(where).resolve()}:{name}"
    spec = {"build": build, "model_path": str(model_path), "data_path": str(data_path),
            "output_dir": str(out / "trainer"), "world_size": config.world_size, "accum_steps": config.accum_steps,
            "per_device_batch": config.per_device_batch}
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec))
    worker = ["-m", "gradnorm.audit.trainer.worker", str(out / "spec.json")]
    if config.world_size == 1:
        argv = [sys.executable, *worker]
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={config.world_size}",
                *worker]
    what = f"the trainer of {build} under {config.title}"
    env = _env(out, vocab_size, site=False)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH", "")) if p)  # module:function
    _run(argv, env, out, timeout, what, cwd=out)
    return records(out, what)


def fill(command: list[str], model_path: Path, data_path: Path, output_dir: Path) -> list[str]:
    """``command`` with the probe's paths where its placeholders are; one that has none is refused."""
    values = {"{model}": str(model_path), "{data}": str(data_path), "{output_dir}": str(output_dir)}
    filled = []
    for arg in command:
        for key, value in values.items():
            arg = arg.replace(key, value)
        filled.append(arg)
    used = [key for key in values if any(key in arg for arg in command)]
    if "{model}" not in used:
        raise TrainerError("the script's command has no {model} placeholder: write {model} where it takes the path "
                           "of the model to load (and {data} where it takes its data set)")
    return filled


def run_script(command: list[str], model_path: Path, data_path: Path, vocab_size: int, out: Path,
               timeout: float) -> list[dict]:
    """Run the user's command as typed, placeholders filled, the recorder installed by ``site/``."""
    argv = fill(command, model_path, data_path, out / "trainer")
    what = f"the command {' '.join(command[:3])}{' ...' if len(command) > 3 else ''}"
    try:
        _run(argv, _env(out, vocab_size, site=True), out, timeout, what)
    except FileNotFoundError:
        raise TrainerError(f"cannot run {argv[0]!r}: no such command") from None
    recs = records(out, what)
    if all(not r["forwards"] for r in recs):
        raise TrainerError(f"{what} stepped an optimizer but never ran the probe model: does it load the model from "
                           "{model}?")
    return recs
