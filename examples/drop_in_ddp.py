"""gradnorm as a drop-in: exact GRPO loss normalization in a plain PyTorch DDP loop with accumulation.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 examples/drop_in_ddp.py --denominator token
    python -m gradnorm.audit examples/drop_in_ddp.py:grpo_loss --world-size 8 --accum-steps 4   # INVARIANT

The lines between the two ``drop-in`` markers are the whole change to a training loop, and the
README shows exactly them ("Use the fix in your own loop"; tests/distributed/test_drop_in.py checks the two
are equal, runs them on 2 gloo ranks against a one-process oracle and audits ``grpo_loss``). Per
optimizer step each rank counts the response tokens of all its microbatches, ONE all-reduce sums
the counts over ranks, and each microbatch's loss weighs its tokens with the global counts. The
rest of this file is a toy policy and a toy minibatch, so that the example runs as it is.
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from gradnorm import Counts, count_tokens, loss_weights
from gradnorm.dist.comm import exit_without_finalizing  # flushes stdout, then os._exit


# --- drop-in: begin (README.md shows these lines) ---
def grpo_loss(logp, old_logp, advantages, mask, *, num_tokens, num_sequences, num_groups, group_tokens,
              world_size, accum_steps, denominator="token"):
    """One microbatch's loss: sum of W * w * l; DDP's mean over W ranks then leaves the gradient of J."""
    ratio, adv = torch.exp(logp - old_logp), advantages.unsqueeze(-1)  # (n, T), (n, 1)
    l = -torch.min(ratio * adv, ratio.clamp(0.8, 1.28) * adv)  # (n, T) the clipped surrogate
    w = loss_weights(mask, denominator, num_tokens=num_tokens, num_sequences=num_sequences, num_groups=num_groups,
                     group_tokens=group_tokens, world_size=world_size, accum_steps=accum_steps, dtype=logp.dtype)
    return (world_size * w * torch.where(mask, l, 0.0)).sum()  # x W undoes DDP's mean, here and only here


def accumulate(ddp_model, microbatches, num_groups, denominator="token"):
    """Backward of this rank's A microbatches with the counts of the whole minibatch; then optimizer.step()."""
    W, A = dist.get_world_size(), len(microbatches)
    local = sum(count_tokens(mb["mask"].sum(-1), mb["group_ids"], num_groups) for mb in microbatches)
    dist.all_reduce(local)  # THE one all-reduce: [N, S_tok, N_0..N_{G-1}] over every rank and microbatch
    counts = Counts.from_vector(local)
    for m, mb in enumerate(microbatches):
        with ddp_model.no_sync() if m < A - 1 else nullcontext():  # gradients add up; the last one syncs
            logp = token_logprobs(ddp_model, mb["tokens"])  # (n, T) your forward pass
            grpo_loss(logp, mb["old_logp"], mb["advantages"], mb["mask"], **counts.for_microbatch(mb["group_ids"]),
                      world_size=W, accum_steps=A, denominator=denominator).backward()
# --- drop-in: end ---


VOCAB, WIDTH = 16, 8


def toy_policy(seed: int = 0) -> nn.Module:
    """A bigram policy: the next token's logits from the current token alone."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB)).double()


def token_logprobs(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """(n, T) log pi(token t+1 | token t) for tokens (n, T + 1)."""
    logp = torch.log_softmax(model(tokens[:, :-1]), dim=-1)  # (n, T, V)
    return logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


def toy_minibatch(model: nn.Module, num_groups: int = 4, group_size: int = 4, max_len: int = 12, seed: int = 0) -> dict:
    """S = num_groups * group_size sequences with ragged responses (1 to max_len tokens), advantages
    centered per group, old log-probs a little off the current policy (so the clip can act)."""
    gen = torch.Generator().manual_seed(seed)
    S = num_groups * group_size
    lengths = torch.randint(1, max_len + 1, (S,), generator=gen)
    lengths[: S // 4] = torch.randint(1, 3, (S // 4,), generator=gen)  # a few very short responses
    tokens = torch.randint(0, VOCAB, (S, max_len + 1), generator=gen)
    rewards = torch.rand(S, generator=gen, dtype=torch.float64).view(num_groups, group_size)
    advantages = (rewards - rewards.mean(-1, keepdim=True)).flatten()
    with torch.no_grad():
        old_logp = token_logprobs(model, tokens) + 0.1 * torch.randn(S, max_len, generator=gen, dtype=torch.float64)
    return {"tokens": tokens, "mask": torch.arange(max_len) < lengths.unsqueeze(-1), "advantages": advantages,
            "old_logp": old_logp, "group_ids": torch.arange(S) // group_size}


def microbatches_of(batch: dict, rank: int, world_size: int, accum_steps: int) -> list[dict]:
    """This rank's A microbatches, the sequences sorted by response length first: low ranks get the
    short responses, so per-microbatch token counts differ as much as they can."""
    order = torch.argsort(batch["mask"].sum(-1), stable=True)
    mine = order.chunk(world_size * accum_steps)[rank * accum_steps:(rank + 1) * accum_steps]
    return [{key: value[idx] for key, value in batch.items()} for idx in mine]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--denominator", default="token", help="local, token, sequence, group or a number C")
    parser.add_argument("--accum-steps", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        model = toy_policy()
        batch = toy_minibatch(model)
        ddp_model = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        microbatches = microbatches_of(batch, dist.get_rank(), dist.get_world_size(), args.accum_steps)
        accumulate(ddp_model, microbatches, num_groups=4, denominator=args.denominator)
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
