"""The math of gradnorm: pure torch, no torch.distributed, nothing else of gradnorm imported.

- ``denominators``  every mode as a per-token weight: counts, weights, the backward loss
- ``modes``         the mode names (the core's, plus Dr GRPO's constant) and what resolves them
- ``sft``           SFT's label tokens: the same token weights, counted from the label mask
- ``pairs``         DPO and its family: a weight per preference pair, and the pair losses
- ``grpo``          advantages, clipped surrogate, KL estimators, entropy, step statistics
- ``importance``    truncated or masked importance sampling against a rollout engine's log-probs
- ``sharding``      explicit plans: which rank and microbatch holds which sequence
- ``simulate``      the same weights and gradients for W simulated ranks in one process
- ``accumulate``    one rank's microbatches of one step, backpropagated with the global counts
"""
