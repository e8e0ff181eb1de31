"""What a run saves and when: checkpoint directories (``store``), RNG states (``rng``), the run's
counters and the save policy (``checkpointer``), and the Hugging Face export (``export``)."""
