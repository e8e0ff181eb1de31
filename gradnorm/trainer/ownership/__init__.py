"""Who owns the run directory, and what a restart makes of it: rank 0's lock, the ``.gradnorm-run``
marker, ``--overwrite``'s ``previous_run/`` and the journal that keeps moving a run whole after a
kill (``lock``); config.json, its history and what ``--resume`` checks (``history``); what
``--auto-resume`` makes of the directory (``restart``). One filesystem transaction across those
files; what the run writes into the directory is ``gradnorm.trainer.logs``."""
