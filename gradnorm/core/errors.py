"""One line of an error, for the one-line reports every command makes (``error: ...``)."""

from __future__ import annotations


def first_line(err: BaseException, limit: int = 200) -> str:
    """The first non-blank line of ``err``'s message, at most ``limit`` characters; never raises.

    An exception with an empty or blank message gives its type's name instead, so a report never
    ends in an empty pair of parentheses (``str(err).splitlines()[0]`` raises IndexError there).
    """
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return (lines[0] if lines else type(err).__name__)[:limit]
