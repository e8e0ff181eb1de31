"""The user's own code, named on a command line as ``module:function``: loading it, and its failures.

User code is what the user wrote and a command calls: the trainer's ``--reward``, the loss that
``python -m gradnorm.audit`` audits. ``load_function`` imports ``package.module:function`` (and,
where the command takes files, runs ``path/to/file.py`` for ``path/to/file.py:function``) and
returns the function. Every way that fails is one ``UserCodeError``: its ``kind`` says which,
its message says it in one line, and its fields let a command say it in its own words.
``restored_imports`` puts sys.path and sys.modules back as they were once the code has run.

Whatever user code raises is its failure, not the command's (``USER_EXITS``), sys.exit() and
KeyboardInterrupt included; ``describe`` names it in one line, ``user_frames`` shows where in the
user's files it happened.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import itertools
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

class ProcessExit(BaseException):
    """User code called ``os._exit(code)`` inside ``no_process_exit``: raised in its place, so that
    the command fails in one line instead of ending at once, with the user's code as its exit code
    (0 would read as success) and no word of why."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


USER_EXITS = (Exception, SystemExit, KeyboardInterrupt, ProcessExit)
"""What user code may raise that is its failure, not the command's: a sys.exit(0) in it must not end
the command with exit 0, a KeyboardInterrupt it raises itself must not end it with a traceback (a
real Ctrl-C never raises in the trainer: ``guards.preemption.catch_signals`` turns it into a stop
request), an ``os._exit`` under ``no_process_exit`` is a ``ProcessExit``."""


@contextlib.contextmanager
def no_process_exit() -> Iterator[None]:
    """``os._exit`` raises ``ProcessExit`` inside the with-block instead of ending the process.

    For user code run in the command's own process (the trainer's reward): ``os._exit`` skips every
    handler, so nothing after it could say what happened. A segfault or a hang still cannot be
    caught in-process; ``python -m gradnorm.audit`` runs its user code in a child process for those
    (``gradnorm.audit.cli.main(isolate=True)``).
    """

    def refuse(code: int) -> None:
        raise ProcessExit(code)

    real, os._exit = os._exit, refuse
    try:
        yield
    finally:
        os._exit = real


def describe(err: BaseException, quoted: bool = False) -> str:
    """``err`` in one line: ``KeyError: 'x'``, or with ``quoted`` ``KeyError("'x'")``; ``SystemExit(0)`` either way.

    A sys.exit(code) names the code the user's code passed, never passes it on. ``quoted`` keeps
    the message verbatim, as a repr, for a report whose user frames follow (the trainer's
    ``RewardError``); without it the message's whitespace is folded onto one line (the audit's).
    """
    if isinstance(err, SystemExit):
        return f"SystemExit({err.code!r})"
    if isinstance(err, ProcessExit):
        return f"os._exit({err.code!r})"
    if quoted:
        return f"{type(err).__name__}({str(err)!r})"
    return " ".join(f"{type(err).__name__}: {err}".split())


# Frames of gradnorm and of the import machinery only say who called the user's code.
_PLUMBING = (str(Path(__file__).resolve().parents[1]), str(Path(importlib.__file__).parent), "<frozen")


def user_frames(err: BaseException) -> str:
    """The frames of ``err`` outside gradnorm and importlib, formatted like a traceback's."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(_PLUMBING)]
    lines = traceback.format_list(frames)
    if isinstance(err, SyntaxError):  # where the parser stopped: file, line and caret
        lines += traceback.format_exception_only(type(err), err)[:-1]
    return "".join(lines).rstrip("\n")


class UserCodeError(ValueError):
    """``spec`` names no function that can be loaded; ``str()`` says why in one line.

    ``kind`` is one of ``KINDS``: "spec" (not module:function), "no file", "no module" (the module
    itself is not importable: ``cause`` is the ModuleNotFoundError), "import" (importing it raised
    ``cause``, the user's own failure), "no function" (the module has no attribute ``name``),
    "not callable" (it has one, ``found``). ``where`` is the module or the file as ``spec`` wrote it.
    """

    KINDS = ("spec", "no file", "no module", "import", "no function", "not callable")

    def __init__(self, message: str, kind: str, spec: str, where: str = "", name: str = "",
                 cause: BaseException | None = None, found: object = None):
        super().__init__(message)
        self.kind, self.spec, self.where, self.name, self.cause, self.found = kind, spec, where, name, cause, found


_MISSING = object()
_loaded_files = itertools.count()  # makes every loaded file's module name unique


def _import_file(path: Path):
    """Execute ``path`` as a module registered in sys.modules, with its folder on sys.path.

    Registered before it runs, under a name no other module has, because ``@dataclass`` (and
    ``typing.get_type_hints``) looks the class's module up in sys.modules while the file executes:
    under ``from __future__ import annotations`` an unregistered module fails there. The folder
    goes first on sys.path, as ``python path/to/file.py`` puts it, so ``import neighbour`` finds the
    file beside it from any working directory. Both stay after loading: the function may import
    lazily, on its first call. ``restored_imports`` removes them when the caller is done.
    """
    name = f"_gradnorm_user_{next(_loaded_files)}_{''.join(c if c.isalnum() else '_' for c in path.stem)}"
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def load_function(spec: str, files: bool = True) -> Callable:
    """``package.module:function`` (or, with ``files``, ``path/to/file.py:function``) -> the function.

    Raises ``UserCodeError``, whose message names what failed: ``cannot import WHERE: describe(err)``,
    ``no such file: WHERE``, ``WHERE has no function 'NAME'``, or what ``spec`` should look like.
    A file's module stays registered and its folder on sys.path (see ``_import_file``); run the
    function inside ``restored_imports`` to have both removed afterwards.
    """
    where, sep, name = spec.rpartition(":")
    if not (sep and where and name):
        shape = "package.module:function or file.py:function" if files else "package.module:function"
        raise UserCodeError(f"expected {shape}, got {spec!r}", "spec", spec)
    is_file = files and (where.endswith(".py") or "/" in where)
    if is_file and not Path(where).is_file():
        raise UserCodeError(f"no such file: {where}", "no file", spec, where, name)
    try:
        module = _import_file(Path(where).resolve()) if is_file else importlib.import_module(where)
    except USER_EXITS as err:  # whatever the user's module raises (or exits with) on import
        missing = (not is_file and isinstance(err, ModuleNotFoundError) and err.name is not None
                   and (where + ".").startswith(err.name + "."))  # the module itself, not one it imports
        raise UserCodeError(f"cannot import {where}: {describe(err)}", "no module" if missing else "import", spec,
                            where, name, cause=err) from None
    fn = getattr(module, name, _MISSING)
    if fn is _MISSING:
        raise UserCodeError(f"{where} has no function {name!r}", "no function", spec, where, name)
    if not callable(fn):
        raise UserCodeError(f"{where} has no function {name!r}", "not callable", spec, where, name, found=fn)
    return fn


@contextlib.contextmanager
def restored_imports() -> Iterator[None]:
    """sys.path and sys.modules after the with-block as they were before, as far as loading changed them.

    Only what loading added goes: the folders it put on sys.path, and the modules imported from
    those folders (a loaded file itself, the neighbours it imported, lazily or not). Modules that
    the user's code imported from elsewhere (torch's lazily loaded parts) stay, as they would anyway.
    """
    path_before, modules_before = list(sys.path), set(sys.modules)
    try:
        yield
    finally:
        added = [folder for folder in sys.path if folder not in path_before]
        for name in set(sys.modules) - modules_before:
            origin = getattr(sys.modules.get(name), "__file__", None) or ""
            if any(Path(origin).is_relative_to(folder) for folder in added):
                sys.modules.pop(name, None)
        sys.path[:] = [folder for folder in sys.path if folder not in added]
