"""The tiny trainer configuration, defined once, and how the trainer tests run it.

``TINY`` is the base: 2 prompts x 2 completions, a 2-step warm-up, a 1-layer TinyGPT of width 16,
no plot, seed 3; a run of a few steps takes a second or two. A test that needs another value
says so where it uses it, with ``tiny(flag=value)``: the flag's value replaced in place (so the
command line reads as TINY's with that one change), ``None`` to leave the flag out (the trainer's
default), and a flag that TINY lacks appended. For example

    FLAGS = tiny(warmup_steps="0")  # the faults come in the GRPO steps: no warm-up before them

Every run of a test module goes through ``run_main`` (in this process) or ``torchrun_cmd`` (2
ranks by default), both on TINY unless given ``base=``.
"""

from pathlib import Path

TINY = ("--prompts-per-step", "2", "--group-size", "2", "--warmup-steps", "2", "--eval-prompts", "2",
        "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--no-plot", "--seed", "3")


def tiny(**changes: str | None) -> list[str]:
    """TINY with ``changes``: ``warmup_steps="0"`` is ``--warmup-steps 0``; None drops the flag."""
    argv = list(TINY)
    for name, value in changes.items():
        flag = "--" + name.replace("_", "-")
        if flag in argv:
            at = argv.index(flag)
            takes_value = at + 1 < len(argv) and not argv[at + 1].startswith("--")
            del argv[at:at + 1 + takes_value]
            if value is not None:
                argv[at:at] = [flag, value] if takes_value else [flag]
        elif value is not None:
            argv += [flag, value]
    return argv


def run_main(out: Path, *flags: str, base=TINY) -> int:
    """Exit status of the trainer's ``main()`` in this process, on ``base`` + ``--output-dir out`` + ``flags``."""
    from gradnorm.train import main

    return main([*base, "--output-dir", str(out), *flags])


def torchrun_cmd(out: Path, *flags: str, nproc: int = 2, base=TINY) -> list[str]:
    """argv of a torchrun launch of ``nproc`` ranks of gradnorm/train.py on ``base`` + ``--output-dir out`` + ``flags``."""
    from gradnorm.teach.launch import torchrun_command

    return torchrun_command(nproc, *base, "--output-dir", str(out), *flags)


def one_error_line(stderr: str, says: str = "", alone: bool = False) -> str:
    """The one ``error: `` line of ``stderr``, which says ``says``; no traceback.

    ``alone``: that line is all of stderr (no warning, no usage text before or after it), as a
    command that refuses its flags before doing anything prints it.
    """
    lines = stderr.splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    if alone:
        assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], stderr
        assert "usage:" not in stderr, stderr
    else:
        assert len(errors) == 1, stderr
        assert says in errors[0], stderr
    assert "Traceback" not in stderr, stderr
    return errors[0]
