"""gradnorm: exact loss normalization for GRPO, SFT and DPO under data parallelism and gradient accumulation.

Every normalization mode is a per-token weight ``w[i, t]`` in the minibatch objective

    J = sum_{i,t} w[i, t] * l[i, t] * M[i, t]

and the modes differ only in ``w``. The packages, and what each may import (docs/design.md has
the whole map and one optimizer step's data flow):

- ``core``     the math: denominators, GRPO loss pieces, sharding plans, simulation, accumulation
- ``cli``      what every command shares with its user: one-line usage errors, loading user code
- ``dist``     the only torch.distributed code: process group and THE count all-reduce, DDP/FSDP2,
               sharded state, spawned gloo ranks
- ``models``   TinyGPT and Hugging Face causal LMs, and the sampling loop they share
- ``tasks``    the built-in task, JSONL prompts, rewards
- ``trainer``  the GRPO trainer behind ``gradnorm/train.py`` (and ``python -m gradnorm.export``)
- ``teach``    what the notebooks and figures use
- ``audit``    ``python -m gradnorm.audit``: the token weights of any trainer's loss
"""

# The public API, stable (README, "Use the fix in your own loop"): count, one all-reduce, weights,
# for GRPO's tokens, SFT's label tokens and DPO's pairs.
from gradnorm.core.denominators import (
    MODES,
    Counts,
    Denominator,
    count_tokens,
    loss_weights,
    parse_denominator,
    token_weights,
)
from gradnorm.core.pairs import PAIR_MODES, count_pairs, dpo_losses, pair_weights, response_logps
from gradnorm.core.sft import IGNORE_INDEX, SFT_MODES, count_labels, label_logprobs, sft_weights

__all__ = ["IGNORE_INDEX", "MODES", "PAIR_MODES", "SFT_MODES", "Counts", "Denominator", "count_labels", "count_pairs",
           "count_tokens", "dpo_losses", "label_logprobs", "loss_weights", "pair_weights", "parse_denominator",
           "response_logps", "sft_weights", "token_weights"]
