"""A closed standard output ends the reader's interest, not the run.

``train.py ... | head -1`` closes the pipe after one line; the next print raised BrokenPipeError and
the run died without a checkpoint. ``survive_closed_stdout`` makes the first write that finds the
pipe closed point file descriptor 1 at /dev/null, say so once on stderr, and let the command go
on: the run's own record (metrics.jsonl, checkpoints) never went through stdout.
"""

from __future__ import annotations

import os
import sys


class _ClosedPipeSafe:
    """``stream`` whose writes and flushes, once the reader has gone, go nowhere instead of raising."""

    def __init__(self, stream, said: str):
        self._stream, self._said, self._gone = stream, said, False

    def _drop(self) -> None:
        if not self._gone:
            self._gone = True
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:  # the interpreter's own flush at exit must not find the closed pipe again
                os.dup2(devnull, self._stream.fileno())
            except (OSError, ValueError):
                pass
            finally:
                os.close(devnull)
            print(f"warning: standard output was closed (a pipe into head?); {self._said}", file=sys.stderr,
                  flush=True)

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._drop()
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._drop()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def survive_closed_stdout(said: str) -> None:
    """From now on a closed stdout is a warning saying ``said`` (what goes on), once; never an error."""
    if not isinstance(sys.stdout, _ClosedPipeSafe):
        sys.stdout = _ClosedPipeSafe(sys.stdout, said)
