"""``python -m gradnorm.audit``: the command lives in ``gradnorm.audit.cli``; the user's code runs in a
child process (``main(isolate=True)``), so that nothing it does can end the command with a verdict.
``--trainer`` and ``--script`` are the trainer audit's (``gradnorm.audit.trainer.cli``)."""

import sys

_before_command = sys.argv[1:sys.argv.index("--")] if "--" in sys.argv else sys.argv[1:]
if "--trainer" in _before_command or "--script" in _before_command:
    from gradnorm.audit.trainer.cli import main as trainer_main  # the trainer audit: its user code runs in launches of its own

    sys.exit(trainer_main())

from gradnorm.audit.cli import main  # noqa: E402

sys.exit(main(isolate=True))
