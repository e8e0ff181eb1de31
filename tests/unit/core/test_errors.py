"""``first_line``: the one line of an error that every one-line report uses, and that never raises."""

import pytest

from gradnorm.core.errors import first_line


def test_the_first_non_blank_line_cut_to_the_limit():
    assert first_line(ValueError("\n  bad flag  \nmore detail")) == "bad flag"
    assert first_line(OSError("x" * 500), limit=10) == "x" * 10


def test_an_empty_or_blank_message_gives_the_type_name():
    for err in (RuntimeError(""), ValueError("  \n ")):
        assert first_line(err) == type(err).__name__
        with pytest.raises(IndexError):  # the control: the expression first_line replaced
            str(err).strip().splitlines()[0]
