"""gradnorm as a drop-in for SFT: the label tokens' cross-entropy over the global count, in a DDP loop.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 examples/drop_in_sft.py --denominator token
    python -m gradnorm.audit examples/drop_in_sft.py:sft_loss --objective sft --world-size 8 --accum-steps 4

A model's own ``outputs.loss`` is the mean over the microbatch's label tokens; divided by A and
averaged by DDP over W ranks, a label token of a microbatch with few labels (a short answer, a
long prompt) weighs more than one of a microbatch with many. The lines between the two
``drop-in`` markers are the fix (tests/distributed/test_drop_in_post_training.py runs them on 2 gloo ranks
against a one-process oracle and audits ``sft_loss``): per optimizer step each rank counts the
label tokens of all its microbatches, ONE all-reduce sums the counts over ranks, and each
microbatch weighs its label tokens with the global counts. The toy policy is drop_in_ddp.py's.
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch
import torch.distributed as dist
from drop_in_ddp import VOCAB, toy_policy  # the same bigram policy as the GRPO example
from torch import nn

from gradnorm import IGNORE_INDEX, count_labels, label_logprobs, sft_weights
from gradnorm.dist.comm import exit_without_finalizing  # flushes stdout, then os._exit


# --- drop-in: begin ---
def sft_loss(logp, mask, *, num_tokens, num_sequences, world_size, accum_steps, denominator="token"):
    """One microbatch's loss: -sum of W * w * log p over its labels; DDP's mean then leaves the gradient of J."""
    w = sft_weights(mask, denominator, num_tokens=num_tokens, num_sequences=num_sequences, world_size=world_size,
                    accum_steps=accum_steps, dtype=logp.dtype)
    return -(world_size * w * torch.where(mask, logp, 0.0)).sum()  # x W undoes DDP's mean, here and only here


def accumulate(ddp_model, microbatches, denominator="token"):
    """Backward of this rank's A microbatches with the label counts of the whole minibatch; then optimizer.step()."""
    W, A = dist.get_world_size(), len(microbatches)
    local = sum(count_labels(mb["labels"] != IGNORE_INDEX) for mb in microbatches)
    dist.all_reduce(local)  # THE one all-reduce: [N, S_tok] over every rank and microbatch
    num_tokens, num_sequences = local.tolist()
    for m, mb in enumerate(microbatches):
        with ddp_model.no_sync() if m < A - 1 else nullcontext():  # gradients add up; the last one syncs
            logp, mask = label_logprobs(ddp_model(mb["inputs"]), mb["labels"])  # (n, T) your forward pass
            sft_loss(logp, mask, num_tokens=num_tokens, num_sequences=num_sequences, world_size=W, accum_steps=A,
                     denominator=denominator).backward()
# --- drop-in: end ---


def toy_sft_batch(num_sequences: int = 16, max_len: int = 12, seed: int = 0) -> dict:
    """Token sequences whose first positions are a prompt (labels -100) and whose last ones are padding:
    answers of 1 to max_len - 2 label tokens, a quarter of them only 1 or 2 long."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (num_sequences, max_len + 1), generator=gen)
    prompt = torch.randint(1, 3, (num_sequences,), generator=gen)
    answer = torch.randint(1, max_len - 1, (num_sequences,), generator=gen)
    answer[: num_sequences // 4] = torch.randint(1, 3, (num_sequences // 4,), generator=gen)
    position = torch.arange(max_len)
    is_label = (position >= prompt.unsqueeze(-1) - 1) & (position < (prompt + answer).unsqueeze(-1) - 1)
    labels = tokens[:, 1:].masked_fill(~is_label, IGNORE_INDEX)  # labels[t]: the token after position t
    return {"inputs": tokens[:, :-1], "labels": labels}


def microbatches_of(batch: dict, rank: int, world_size: int, accum_steps: int) -> list[dict]:
    """This rank's A microbatches, the sequences sorted by label count first: low ranks get the short
    answers, so per-microbatch label counts differ as much as they can."""
    order = torch.argsort((batch["labels"] != IGNORE_INDEX).sum(-1), stable=True)
    mine = order.chunk(world_size * accum_steps)[rank * accum_steps:(rank + 1) * accum_steps]
    return [{key: value[idx] for key, value in batch.items()} for idx in mine]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--denominator", default="token", help="local, token, sequence or a number C")
    parser.add_argument("--accum-steps", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        model = toy_policy()
        ddp_model = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        microbatches = microbatches_of(toy_sft_batch(), dist.get_rank(), dist.get_world_size(), args.accum_steps)
        accumulate(ddp_model, microbatches, denominator=args.denominator)
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
