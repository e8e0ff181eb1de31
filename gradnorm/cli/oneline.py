"""The argparse parser of every command: a bad flag is one line, never argparse's usage block.

``OneLineParser(...)`` prints ``error: MESSAGE (see --help)`` on stderr and exits 2, as the
trainer and ``python -m gradnorm.export`` do. ``OneLineParser(..., raises=SomeError)`` raises
``SomeError(MESSAGE)`` instead, for a command that reports every error of its own in one place
(``python -m gradnorm.audit``: flags, an unimportable loss and a broken contract alike).
"""

from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose ``error`` is one line: exit 2 with ``error: ...``, or ``raises(message)``."""

    def __init__(self, *args, raises: type[Exception] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.raises = raises

    def error(self, message: str):  # argparse prints usage too; a bad flag deserves one line
        if self.raises is not None:
            raise self.raises(message)
        self.exit(2, f"error: {message} (see --help)\n")
