"""The decode loop's batch sizes written out longhand: the reference of the tests that watch finished
rows leave the batch (tests/unit/trainer/test_rollout.py on TinyGPT, tests/unit/models/test_hfmodels.py
on Hugging Face models)."""

from gradnorm.models.sampling import DROP_AT


def decode_batch_sizes(B: int, running: list[int]) -> list[int]:
    """Longhand: the batch of each forward (the prefill first) when running[t] rows are left after draw t."""
    sizes = [B]
    for left in running:
        left = max(left, 1)  # a batch never empties: a finished row stands in
        sizes.append(left if B - left >= DROP_AT * B else B)
        B = sizes[-1]
    return sizes
