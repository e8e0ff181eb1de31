"""``python -m gradnorm.audit``: the command lives in ``gradnorm.audit.cli``."""

import sys

from gradnorm.audit.cli import main

sys.exit(main())
