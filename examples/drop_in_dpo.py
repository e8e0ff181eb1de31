"""gradnorm as a drop-in for DPO: every preference pair weighs 1/P of the step, in a DDP loop.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 examples/drop_in_dpo.py --denominator pair
    python -m gradnorm.audit examples/drop_in_dpo.py:dpo_loss --objective dpo --world-size 8 --accum-steps 4

``losses.mean()`` per microbatch, divided by A and averaged by DDP over W ranks, is exact only
while every microbatch holds the same number of pairs; under a token budget a microbatch of long
pairs holds fewer of them, and each of its pairs weighs more. The lines between the two
``drop-in`` markers are the fix (tests/distributed/test_drop_in_post_training.py runs them on 2 gloo ranks
against a one-process oracle and audits ``dpo_loss``): per optimizer step each rank counts its
pairs, ONE all-reduce sums the counts over ranks, and each pair's loss weighs 1/P. The toy policy
is drop_in_ddp.py's; the reference policy is another draw of it.
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch
import torch.distributed as dist
from drop_in_ddp import VOCAB, token_logprobs, toy_policy  # the same bigram policy as the GRPO example
from torch import nn

from gradnorm import count_pairs, dpo_losses, pair_weights
from gradnorm.dist.comm import exit_without_finalizing  # flushes stdout, then os._exit


# --- drop-in: begin ---
def dpo_loss(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, chosen_mask, rejected_mask, *,
             num_pairs, world_size, accum_steps, beta=0.1, denominator="pair", length_normalized=False):
    """One microbatch's loss: sum of W * v_p * l_p over its pairs; DDP's mean then leaves the gradient of J."""
    losses = dpo_losses(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, chosen_mask, rejected_mask,
                        beta=beta, length_normalized=length_normalized)  # (pairs,) l_p = -log sigmoid(beta m_p)
    v = pair_weights(len(losses), denominator, num_pairs=num_pairs, world_size=world_size, accum_steps=accum_steps,
                     dtype=losses.dtype, device=losses.device)
    return (world_size * v * losses).sum()  # x W undoes DDP's mean, here and only here


def accumulate(ddp_model, ref_model, microbatches, denominator="pair", beta=0.1, length_normalized=False):
    """Backward of this rank's A microbatches with the pair count of the whole minibatch; then optimizer.step()."""
    W, A = dist.get_world_size(), len(microbatches)
    local = sum(count_pairs(len(mb["chosen"])) for mb in microbatches)
    dist.all_reduce(local)  # THE one all-reduce: [P] over every rank and microbatch
    num_pairs = int(local[0])
    for m, mb in enumerate(microbatches):
        both, n = torch.cat([mb["chosen"], mb["rejected"]]), len(mb["chosen"])  # one forward for the pair
        with torch.no_grad():
            ref = token_logprobs(ref_model, both)
        with ddp_model.no_sync() if m < A - 1 else nullcontext():  # gradients add up; the last one syncs
            logp = token_logprobs(ddp_model, both)  # (2n, T) your forward pass
            dpo_loss(logp[:n], logp[n:], ref[:n], ref[n:], mb["chosen_mask"], mb["rejected_mask"],
                     num_pairs=num_pairs, world_size=W, accum_steps=A, beta=beta, denominator=denominator,
                     length_normalized=length_normalized).backward()
# --- drop-in: end ---


def toy_pairs(num_pairs: int, max_len: int = 12, seed: int = 0) -> dict:
    """``num_pairs`` preference pairs of token sequences, responses of 1 to max_len tokens."""
    gen = torch.Generator().manual_seed(seed)
    batch = {}
    for side in ("chosen", "rejected"):
        lengths = torch.randint(1, max_len + 1, (num_pairs,), generator=gen)
        batch[side] = torch.randint(0, VOCAB, (num_pairs, max_len + 1), generator=gen)
        batch[f"{side}_mask"] = torch.arange(max_len) < lengths.unsqueeze(-1)
    return batch


def microbatches_of(batch: dict, rank: int, world_size: int, accum_steps: int) -> list[dict]:
    """This rank's A microbatches as a token budget would cut them: pairs sorted longest first, the
    k-th of the W * A microbatches holding k pairs, so the long pairs sit few to a microbatch.
    The batch must hold 1 + 2 + ... + W * A pairs."""
    k = world_size * accum_steps
    assert len(batch["chosen"]) == k * (k + 1) // 2, "toy_pairs(num_pairs=k * (k + 1) // 2) for k = W * A"
    length = batch["chosen_mask"].sum(-1) + batch["rejected_mask"].sum(-1)
    order = torch.argsort(length, descending=True, stable=True)
    cuts = order.split(list(range(1, k + 1)))[rank * accum_steps:(rank + 1) * accum_steps]
    return [{key: value[idx] for key, value in batch.items()} for idx in cuts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--denominator", default="pair", help="local, pair or a number C")
    parser.add_argument("--accum-steps", type=int, default=2)
    parser.add_argument("--length-normalized", action="store_true", help="mean log-probs per response (SimPO-like)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        model, ref_model = toy_policy(), toy_policy(seed=1)
        ddp_model = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        k = dist.get_world_size() * args.accum_steps
        batch = toy_pairs(num_pairs=k * (k + 1) // 2)
        microbatches = microbatches_of(batch, dist.get_rank(), dist.get_world_size(), args.accum_steps)
        accumulate(ddp_model, ref_model, microbatches, denominator=args.denominator,
                   length_normalized=args.length_normalized)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        optimizer.step()
        optimizer.zero_grad()
        if dist.get_rank() == 0:
            print(f"{args.denominator}: gradient norm {norm:.6f} on {dist.get_world_size()} ranks x "
                  f"{args.accum_steps} microbatches")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # os._exit, not a normal return: a gloo thread still freeing the last all-reduce can abort the
    # finalizing interpreter (SIGABRT), and torchrun then reports a finished run as FAILED
    exit_without_finalizing(0)
