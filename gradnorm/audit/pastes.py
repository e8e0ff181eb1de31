"""The audit's output pasted in Markdown, regenerated: ``python -m gradnorm.audit.pastes FILE.md ...``.

A page shows a command and what it prints as two fenced blocks, one after the other:

    ```bash
    .venv/bin/python -m gradnorm.audit gradnorm.audit.MODULE:FUNCTION FLAGS
    ```

    ```text
    (what it prints)
    ```

Every such pair in the files named is run in-process and its text block replaced with what the
command prints now, so a rewording of the verdicts reaches the pages by one command, not by hand.
Only losses importable from ``gradnorm.audit`` are run: a page's example of your own file is left alone.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

from gradnorm.audit.cli import main

PASTE = re.compile(r"(```bash\n(?:\.venv/bin/)?python -m gradnorm\.audit (gradnorm\.audit\.[^\n]*?)\n```\n\n```text\n)"
                   r".*?```", re.S)
"""A command block of the audit on a catalogue loss, then the text block of its output."""


def printed(argv: list[str]) -> str:
    """What ``python -m gradnorm.audit ARGV`` prints on stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(argv)
    return out.getvalue()


def regenerate(text: str) -> str:
    """``text`` with every pasted output of the audit replaced by what the command prints now."""
    return PASTE.sub(lambda m: m.group(1) + printed(shlex.split(m.group(2))) + "```", text)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        path = Path(name)
        path.write_text(regenerate(path.read_text()))
