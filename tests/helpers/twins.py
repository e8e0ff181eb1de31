"""Which runs of a test session trained the same thing from scratch: the candidates for LAUNCHES.

    .venv/bin/python -m pytest --basetemp=/tmp/suite     # any session, its directories kept in one place
    .venv/bin/python -m tests.helpers.twins /tmp/suite   # without an argument: pytest's newest basetemp

The trainer writes config.json into every run directory: every flag of the run and one
``history`` entry per start. A run is *uninterrupted* when it was trained in its directory (a
copy's config.json names the directory it came from), started once, from step 0, and logged
its last step (``--steps``). Two uninterrupted runs are *twins* when every flag but
where and how they started (``output_dir`` and the resume switches, which change nothing in a
fresh run) is the same, world size and prompt file included: they logged the same steps. Twins
that different tests read are what ``LAUNCHES`` (tests/helpers/launches.py) is for: launch one
and let both read it. Twins within one test are usually meant (the determinism test trains one
configuration twice), and config.json cannot show what a test patched (a fault injected with
monkeypatch trains something else under the same flags): read the tests before sharing a run.

``--ignore save_every,timeout_s`` leaves more flags out of the comparison, ones the reader knows
change no step of a run. The report lists each set of twins with the flags that set apart from
the trainer's defaults and the directory of each run, relative to the basetemp (its first part
is pytest's name for the test's or the module's temporary directory).
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.runfiles import metrics

# Where and how a run started: the same training whatever their values, in a run that started once.
HOW_STARTED = ("output_dir", "resume", "auto_resume", "overwrite", "history")


@dataclass(frozen=True)
class Run:
    directory: Path
    config: dict

    @property
    def copied(self) -> bool:
        """A copy of a run made elsewhere (``shutil.copytree``): its config.json names another --output-dir."""
        return Path(str(self.config.get("output_dir"))).resolve() != self.directory.resolve()

    @property
    def uninterrupted(self) -> bool:
        """Trained here (not a copy), started once, from step 0, and logged its last step (--steps)."""
        if self.copied:
            return False
        history = self.config.get("history", [])
        if len(history) != 1 or history[0].get("step") != 0:
            return False
        try:
            rows = metrics(self.directory)
        except (OSError, ValueError):  # no metrics.jsonl, or a line torn by a kill
            return False
        return bool(rows) and rows[-1].get("step") == self.config.get("steps")


def runs_under(basetemp: Path) -> list[Run]:
    """Every run directory under ``basetemp``: each config.json the trainer wrote, in path order."""
    found = []
    for path in sorted(basetemp.rglob("config.json")):
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(config, dict) and "history" in config:  # the trainer's, not a Hugging Face model's
            found.append(Run(path.parent, config))
    return found


def twins(runs: list[Run], ignore: tuple[str, ...] = ()) -> list[list[Run]]:
    """The sets of two or more uninterrupted runs whose flags agree, but for HOW_STARTED and ``ignore``."""
    left_out = set(HOW_STARTED) | set(ignore)
    by_flags: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        if run.uninterrupted:
            kept = {k: v for k, v in run.config.items() if k not in left_out}
            by_flags[json.dumps(kept, sort_keys=True)].append(run)
    return [group for group in by_flags.values() if len(group) > 1]


def distinctive_flags(config: dict, defaults: dict, ignore: tuple[str, ...] = ()) -> str:
    """The flags of ``config`` that differ from the trainer's ``defaults``, as a command line would say them."""
    left_out = set(HOW_STARTED) | set(ignore)
    parts = []
    for name, value in config.items():
        if name in left_out or name not in defaults or value == defaults[name]:
            continue
        flag = "--" + name.replace("_", "-")
        parts.append(flag if value is True else f"--no-{flag[2:]}" if value is False else f"{flag} {value}")
    return " ".join(parts) + f"  (world size {config.get('world_size')})"


def trainer_defaults() -> dict:
    import dataclasses

    from gradnorm.trainer.config import parse_config

    return dataclasses.asdict(parse_config([]))


def report(basetemp: Path, ignore: tuple[str, ...] = ()) -> str:
    runs = runs_under(basetemp)
    found = twins(runs, ignore)
    lines = [f"{basetemp}: {len(runs)} run directories, {sum(r.uninterrupted for r in runs)} uninterrupted; "
             f"{len(found)} set{'s' * (len(found) != 1)} of twins" + (":" if found else "")]
    defaults = trainer_defaults() if found else {}
    for group in found:
        lines += ["", f"{len(group)} runs of {distinctive_flags(group[0].config, defaults, ignore)}"]
        lines += [f"    {run.directory.relative_to(basetemp)}" for run in group]
    return "\n".join(lines)


def newest_basetemp() -> Path:
    return Path(tempfile.gettempdir()) / f"pytest-of-{getpass.getuser()}" / "pytest-current"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.helpers.twins", description=__doc__.split("\n\n")[0])
    parser.add_argument("basetemp", nargs="?", type=Path, default=None,
                        help="a pytest session's --basetemp (default: pytest's newest, pytest-of-<user>/pytest-current)")
    parser.add_argument("--ignore", default="", help="more flags to leave out of the comparison, comma-separated "
                        "(config.json's names: save_every,timeout_s)")
    args = parser.parse_args(argv)
    basetemp = (args.basetemp or newest_basetemp()).resolve()
    if not basetemp.is_dir():
        print(f"error: {basetemp} is not a directory: give a pytest session's --basetemp", file=sys.stderr)
        return 2
    ignore = tuple(name for name in args.ignore.split(",") if name)
    fields = {*trainer_defaults(), "world_size", "prompts_sha256"}
    unknown = sorted(set(ignore) - fields)
    if unknown:
        print(f"error: --ignore {','.join(unknown)}: not a field of config.json; its fields are "
              f"{', '.join(sorted(fields - set(HOW_STARTED)))}", file=sys.stderr)
        return 2
    print(report(basetemp, ignore))
    return 0


if __name__ == "__main__":
    sys.exit(main())
