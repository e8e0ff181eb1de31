"""What owns the run directory and what is written into it: the lock and ``--overwrite`` (``lock``),
config.json and ``--resume``'s checks (``history``), metrics.jsonl (``metrics``), the console (``console``),
the loggers (``reporters``), the phase times (``phases``), the learning curve (``curves``), and
``runlog.RunLog``, the one object the loop logs through."""
