"""The contract between the audit and the user's loss: what it is called with, and how it breaks.

``loss_fn(logp, old_logp, advantages, mask, **asked)`` -> a scalar tensor, the loss of one
microbatch of n sequences: ``logp`` (n, T) float64, the leaf; ``old_logp`` (n, T);
``advantages`` (n,); ``mask`` (n, T) bool, the response tokens. Only the keywords it names in
its signature are passed (``COUNTS``): the global counts a fixed trainer all-reduces; a loss that
takes ``**kwargs`` gets all of them there.

A loss that cannot be audited, unimportable or breaking the contract, is a ``ContractError``:
one line, no traceback. ``load_loss`` and ``imported_loss`` load it by name, as
``package.module:function`` or ``path/to/file.py:function`` (``gradnorm.cli.usercode``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from gradnorm.audit.objectives import GRPO_KEYWORDS
from gradnorm.cli.usercode import UserCodeError, load_function, restored_imports

COUNTS = GRPO_KEYWORDS
"""Every keyword the audit offers a GRPO loss, and what it holds (each objective's: ``objectives``)."""


class ContractError(ValueError):
    """The loss cannot be audited: unimportable, or it breaks the contract. One line, no traceback."""


def load_loss(spec: str) -> Callable:
    """``package.module:function`` or ``path/to/file.py:function`` -> the function, or a ContractError.

    A file's module stays registered and its folder on sys.path (``gradnorm.cli.usercode``); use
    ``imported_loss`` to have both removed afterwards.
    """
    try:
        return load_function(spec)
    except UserCodeError as err:
        raise ContractError(str(err)) from None


@contextlib.contextmanager
def imported_loss(spec: str) -> Iterator[Callable]:
    """``load_loss`` for the length of a with-block, then sys.path and sys.modules as they were.

    Only what loading added goes (``gradnorm.cli.usercode.restored_imports``): the folders it put
    on sys.path, and the modules imported from those folders (the loss file itself, the neighbours
    it imported, lazily or not).
    """
    with restored_imports():
        yield load_loss(spec)
