"""The contract between the audit and the user's loss: what it is called with, and how it breaks.

``loss_fn(logp, old_logp, advantages, mask, **asked)`` -> a scalar tensor, the loss of one
microbatch of n sequences: ``logp`` (n, T) float64, the leaf; ``old_logp`` (n, T);
``advantages`` (n,); ``mask`` (n, T) bool, the response tokens. Only the keywords it names in
its signature are passed (``COUNTS``): the global counts a fixed trainer all-reduces.

A loss that cannot be audited, unimportable or breaking the contract, is a ``ContractError``:
one line, no traceback. ``load_loss`` and ``imported_loss`` load it by name, as
``package.module:function`` or ``path/to/file.py:function`` (``gradnorm.cli.usercode``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from gradnorm.cli.usercode import UserCodeError, load_function, restored_imports

COUNTS = {
    "ref_logp": "(n, T) reference log-probs; equal to logp here, so a k2/k3 KL has zero gradient",
    "num_tokens": "N: response tokens of the whole minibatch (all ranks, all microbatches) the loss should count",
    "num_sequences": "S_tok: sequences of the minibatch with at least one response token",
    "num_groups": "N_groups: prompt groups of the minibatch with at least one response token",
    "group_tokens": "(k,) int64: N_g(i), the minibatch's token count of each sequence's group",
    "group_ids": "(k,) int64: the global prompt-group index of each sequence",
    "world_size": "W: data-parallel ranks",
    "accum_steps": "A: this rank's microbatches per optimizer step (under a token budget, each rank's own)",
    "sequence_ids": "(n, T) int64: which of the call's k sequences each position belongs to (-1: a packed "
                    "row's padding); row i is sequence i unless rows are packed",
    "sequence_tokens": "(k,) int64: |o_i|, the tokens of each sequence the loss should count (all its chunks)",
    "num_response_tokens": "every generated token of the minibatch, dropped ones included",
    "truncated": "(k,) bool: responses cut at max_new_tokens",
    "rejected": "(n, T) bool: tokens a rejection (importance-sampling) mask drops",
    "context_parallel": "K: ranks each sequence is split over (1 without context parallelism)",
    "pipeline_microbatches": "P: pipeline microbatches a microbatch is cut into (1 without a pipeline)",
}
"""Every keyword the audit offers a loss, and what it holds."""


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
