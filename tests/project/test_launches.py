"""The session's table of shared launches (tests/helpers/launches.py) launches each entry once and
notices a test that wrote into a shared run."""

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.launches import Launched

pytestmark = pytest.mark.launch


@dataclass(frozen=True)
class Counted:
    """A launch that writes one file and counts its starts in ``starts``."""

    starts: Path

    def command(self, out: Path) -> list[str]:
        script = ("import pathlib, sys; out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True); "
                  "(out / 'metrics.jsonl').write_text('{}\\n'); "
                  "open(sys.argv[2], 'a').write('x')")
        return [sys.executable, "-c", script, str(out), str(self.starts)]


def test_each_entry_is_launched_once_and_every_caller_gets_its_directory(tmp_path):
    starts = tmp_path / "starts"
    table = Launched(tmp_path / "runs", {"a": Counted(starts), "b": Counted(tmp_path / "b-starts")})
    table.start("a", "b")
    table.start("a")  # already begun: not again
    first, again = table("a"), table("a")
    assert first == again == tmp_path / "runs" / "a" and (first / "metrics.jsonl").exists()
    assert table("b") == tmp_path / "runs" / "b"
    assert table.close() == []  # nobody wrote into them
    assert starts.read_text() == "x"  # one launch however many callers


def test_control_a_test_that_writes_into_a_shared_run_is_named(tmp_path):
    table = Launched(tmp_path / "runs", {"a": Counted(tmp_path / "starts"), "b": Counted(tmp_path / "b-starts")})
    (table("a") / "metrics.jsonl").write_text('{"step": 1}\n')  # what a resume in place would do
    table("b")
    assert table.close() == ["a"]


def test_a_name_outside_the_table_says_which_names_it_has(tmp_path):
    table = Launched(tmp_path / "runs", {"a": Counted(tmp_path / "starts")})
    with pytest.raises(KeyError, match=r"'nope' is not in .*LAUNCHES: \['a'\]"):
        table("nope")
    table.close()

