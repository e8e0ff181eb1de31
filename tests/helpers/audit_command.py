"""The audit command run in-process, for the audit's test modules."""

from gradnorm.audit.cli import main


def run(capsys, *argv):
    """(exit status, stdout, stderr) of ``python -m gradnorm.audit ARGV``, run in this process."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def verdict_of(out):
    """The one ``verdict: ...`` line of a report."""
    (line,) = [s for s in out.splitlines() if s.startswith("verdict: ")]
    return line
