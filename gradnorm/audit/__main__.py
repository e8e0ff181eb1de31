"""``python -m gradnorm.audit``: the command lives in ``gradnorm.audit.cli``; the user's code runs in a
child process (``main(isolate=True)``), so that nothing it does can end the command with a verdict."""

import sys

from gradnorm.audit.cli import main

sys.exit(main(isolate=True))
