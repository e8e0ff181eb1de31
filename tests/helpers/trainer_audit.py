"""What the trainer audit's tests share: the longhand check that every counted token weighs 1/N."""

import torch


def assert_global_token_mean(report, rtol: float = 1e-5) -> None:
    """Every counted token of every configuration (the reference included) weighs 1/N, N the counted tokens."""
    mask = report.batch.mask
    for res in report.results:
        weights = res.weights[mask]
        torch.testing.assert_close(weights, torch.full_like(weights, 1 / int(mask.sum())), rtol=rtol, atol=0)
