"""Checks of everything outside the flags, before any process group or model exists.

Each check raises a one-line ValueError naming the flag or file and what to do; main() prints it
as ``error: ...`` and exits with 2. They only read (the output directory gets a test file that is
removed at once), so every rank runs them and reaches the same verdict.

- the launch environment: torchrun's variables all set, or none (a stale shell exports some);
- ``--output-dir``: creatable and writable (not a file, not under a file, not in /proc, /sys, /dev);
- ``--prompts``: a readable JSONL file of prompts and answers;
- ``--model``: a local directory with a readable config.json and intact weights, or a Hub name
  (the rule in ``is_local_model``);
- ``--rollout-engine vllm``: vllm installed, and a head size its CPU attention takes;
- ``--reward``: importable, callable as reward(response, answer);
- ``--export-hf``: a directory the end-of-run export may write or replace (``gradnorm.trainer.guards.outpaths``),
  so a bad one is refused before any training rather than after it;
- ``--report-to``: each logger's package imports, and its directory in output-dir is writable."""

from __future__ import annotations

import errno
import importlib
import importlib.util
import json
import os
import re
import tempfile
from pathlib import Path

from gradnorm.core.errors import first_line  # also what main() reports a failed join with
from gradnorm.models import hf, vllm_engine
from gradnorm.tasks.prompts import load_prompts
from gradnorm.tasks.rewards import get_reward
from gradnorm.trainer.config import TrainConfig
from gradnorm.trainer.guards.failures import InputError
from gradnorm.trainer.guards.outpaths import check_export_dir

VIRTUAL_FILESYSTEMS = ("/proc", "/sys", "/dev")


def check_output_dir(path: str) -> None:
    """--output-dir exists as a writable directory, or can be created (nothing is left behind)."""
    absolute = Path(os.path.abspath(path))
    _check_resolvable(path, absolute)
    for root in VIRTUAL_FILESYSTEMS:
        if absolute == Path(root) or Path(root) in absolute.parents:
            raise ValueError(f"--output-dir {path} is under {root}, a virtual filesystem; choose a directory on disk")
    if absolute.exists() and not absolute.is_dir():
        raise ValueError(f"--output-dir {path} is a file, not a directory")
    check_writable(absolute, f"--output-dir {path}")


def check_writable(absolute: Path, said: str) -> None:
    """Files can be created at ``absolute``: in it, or in its nearest existing parent if it does not
    exist yet (a file is created there and removed at once; nothing is left behind)."""
    probe = absolute
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"{said} cannot be created: {probe} is a file")
    try:  # the one reliable test of writability (os.access is wrong for root, ACLs and read-only mounts)
        fd, tmp = tempfile.mkstemp(dir=probe, prefix=".gradnorm-write-test-")
        os.close(fd)
        os.unlink(tmp)
    except OSError as err:
        what = "" if probe == absolute else f" (its nearest existing parent {probe})"
        raise ValueError(f"{said}{what} is not writable: {err.strerror}") from None


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
        _check_hub_id(name)
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


def _check_hub_id(name: str) -> None:
    """A --model read as a Hub id is cached, or can come from the Hub now."""
    # A cached Hub id loads. One that is not must come from the Hub: offline, or with the Hub out of
    # reach, that is known now, in one line, instead of after the loader's retries.
    # Online, a wrong id is checked when it loads (one line if it is not found).
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    local = f"no directory {name} here (a local model: give its path, e.g. ./{name})"
    offline = any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    if offline:
        raise ValueError(f"--model {name}: {local}, and as a Hub id it is not in the local Hugging Face cache, with "
                         "HF_HUB_OFFLINE set; download it first, or give a local directory")
    endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT  # https://huggingface.co by default
    if (why := _unreachable(endpoint)) is not None:
        raise ValueError(f"--model {name}: {local}, and as a Hub id it is not in the local Hugging Face cache and "
                         f"{endpoint} cannot be reached ({why}); download it where there is a network, or give a "
                         "local directory")


def _unreachable(url: str, timeout: float = 3.0) -> str | None:
    """Why a TCP connection to ``url``'s host cannot be made within ``timeout`` seconds, or None.

    Behind a proxy the host is reached through it, not directly: no verdict then (None)."""
    import socket
    import urllib.request
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if urllib.request.getproxies().get(parts.scheme) or urllib.request.getproxies().get("all"):
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname or "", port), timeout=timeout).close()
    except OSError as err:
        return getattr(err, "strerror", None) or type(err).__name__
    return None


def check_inputs(cfg: TrainConfig) -> None:
    """Every file and directory the flags name: the real model's inputs, then the output directory."""
    if not cfg.builtin:
        check_model(cfg.model)
        if cfg.rollout_engine == "vllm":
            check_engine(cfg.model)
        check_prompts(cfg.prompts)
        get_reward(cfg.reward)
    check_output_dir(cfg.output_dir)
    if cfg.export_dir is not None:
        target = check_export_dir(cfg.export_dir, cfg.output_dir, flag="--export-hf")
        # the export writes a temporary sibling and renames it over the target: its parent must take files
        check_writable(target.parent, f"--export-hf {cfg.export_dir}: its parent")
    check_reporters(cfg)


def check_engine(model: str) -> None:
    """--rollout-engine vllm: vllm is installed and its CPU attention takes the model's head size.

    Both are read without importing vllm (seconds); an install that is there but broken, or an
    engine that fails to start, is found when the engine starts (``gradnorm.models.vllm_engine``).
    """
    if is_local_model(model):
        vllm_engine.check_model_shape(model)
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(f"--rollout-engine vllm: vllm is not installed; {vllm_engine.INSTALL_HINT}")
    vllm_engine.check_environment()


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
