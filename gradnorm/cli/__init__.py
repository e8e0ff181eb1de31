"""What every command of gradnorm shares in talking to its user.

- ``oneline``   the argparse parser whose errors are one line: ``error: ...`` and exit 2, or an
                exception of the command's own (the audit's ``ContractError``)
- ``usercode``  the user's own code, named ``module:function`` (or ``file.py:function``): loading
                it, what it may raise that is its failure (``USER_EXITS``), and saying so in one line
- ``pipes``     a standard output its reader closed (``| head``) is a warning, not the end of a run

The one line of any error (``first_line``) is ``gradnorm.core.errors``'s.
"""
