"""What a run writes about itself, for people and tools to read: metrics.jsonl (``metrics``), the
console (``console``), the loggers (``reporters``), the phase times (``phases``), the learning curve
(``curves``), and ``runlog.RunLog``, the one object the loop logs through. Who owns the directory
these land in is ``gradnorm.trainer.ownership``."""
