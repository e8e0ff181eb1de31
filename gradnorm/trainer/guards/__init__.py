"""What stops a run cleanly: checks before anything is built (``launch``, ``preflight``,
``memory``, ``outpaths``), stop signals (``preemption``) and one line for every failure
(``failures``)."""
