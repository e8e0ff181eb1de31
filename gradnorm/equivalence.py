"""The multi-process check: real gloo ranks, real DDP, real accumulation, against the oracle.

``run_ddp(world_size, cases)`` spawns W processes with ``torch.multiprocessing``; each builds the
same small policy and the same ragged GRPO minibatch (``make_problem``), wraps the policy in DDP
and runs ``gradnorm.update.accumulate_gradients`` for every case (denominator, A, sharding),
counting the collectives it issues. The reduced gradient of every case comes back to the caller,
to be compared with a single-process full-batch oracle (tests, notebook 02).
``run_ddp(..., parallel="fsdp")`` wraps the policy in FSDP2 (``fully_shard``) instead; each rank
then holds a shard of the gradient, and the full one is gathered before it is returned.

The worker lives here, importable, because spawned processes must import it by name.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from gradnorm import parallel
from gradnorm.dataparallel import flat_grad, wrap_fsdp
from gradnorm.denominators import Denominator
from gradnorm.grpo import TokenLosses, group_advantages, grpo_token_losses
from gradnorm.sharding import make_plan
from gradnorm.update import accumulate_gradients


@dataclass
class Problem:
    """A fixed GRPO minibatch with ragged response lengths; every rank builds the same one."""

    inputs: Tensor  # (S, T) tokens fed to the policy
    targets: Tensor  # (S, T) tokens whose log-prob is scored
    mask: Tensor  # (S, T) bool response mask
    group_ids: Tensor  # (S,) prompt group of each sequence
    num_groups: int
    old_logp: Tensor  # (S, T) log-probs under the policy that sampled
    ref_logp: Tensor  # (S, T) log-probs under the reference policy
    advantages: Tensor  # (S,)
    beta: float = 0.04

    @property
    def lengths(self) -> Tensor:
        return self.mask.sum(-1)


# 4 groups of 4 completions: group 0 is empty, group 1 short, groups 2 and 3 long.
DEFAULT_LENGTHS = (0, 0, 0, 0, 1, 2, 1, 3, 12, 9, 11, 7, 5, 12, 8, 10)


class TinyPolicy(nn.Module):
    """A small next-token policy: embedding -> tanh MLP -> logits. Enough to carry gradients."""

    def __init__(self, vocab: int = 16, hidden: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.mlp = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: Tensor) -> Tensor:  # (n, T) -> (n, T, V)
        return self.head(torch.tanh(self.mlp(self.embed(tokens))))


def make_policy(seed: int = 0, dtype: torch.dtype = torch.float64) -> TinyPolicy:
    torch.manual_seed(seed)
    return TinyPolicy().to(dtype)


def make_problem(
    lengths: Sequence[int] | None = None,
    group_size: int = 4,
    max_len: int = 12,
    vocab: int = 16,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> Problem:
    """Default: 4 groups of 4; group 0 has no response tokens at all, group 1 very few.

    Contiguous sharding over 4 ranks thus leaves rank 0 with no tokens, and any sharding puts
    very different token counts in different microbatches.
    """
    if lengths is None:
        lengths = DEFAULT_LENGTHS
    g = torch.Generator().manual_seed(seed)
    num_seq = len(lengths)
    inputs = torch.randint(vocab, (num_seq, max_len), generator=g)
    targets = torch.randint(vocab, (num_seq, max_len), generator=g)
    mask = torch.arange(max_len) < torch.tensor(lengths).unsqueeze(-1)
    # Draw everything in float64 and round once, so a float32 problem is the float64 one rounded.
    rewards = torch.rand(num_seq, generator=g, dtype=torch.float64)
    advantages = group_advantages(rewards, group_size)
    with torch.no_grad():
        logp = token_logp(make_policy(seed, torch.float64), inputs, targets)
    # Perturb the sampling policy so that some ratios leave the clip range on both sides.
    old_logp = logp + 0.3 * torch.randn(logp.shape, generator=g, dtype=torch.float64)
    ref_logp = logp + 0.1 * torch.randn(logp.shape, generator=g, dtype=torch.float64)
    advantages, old_logp, ref_logp = (x.to(dtype) for x in (advantages, old_logp, ref_logp))
    return Problem(
        inputs=inputs, targets=targets, mask=mask,
        group_ids=torch.arange(num_seq) // group_size, num_groups=num_seq // group_size,
        old_logp=old_logp, ref_logp=ref_logp, advantages=advantages,
    )


def token_logp(policy: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
    """log pi(targets | inputs) per token, (n, T)."""
    logits = policy(inputs)
    return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_losses(policy: nn.Module, problem: Problem, idx: Tensor) -> TokenLosses:
    """GRPO per-token losses of sequences ``idx`` (clip-higher 0.2 / 0.28, k3 KL)."""
    logp = token_logp(policy, problem.inputs[idx], problem.targets[idx])
    return grpo_token_losses(
        logp, problem.old_logp[idx], problem.advantages[idx],
        ref_logp=problem.ref_logp[idx], beta=problem.beta, clip_low=0.2, clip_high=0.28,
    )


@dataclass(frozen=True)
class Case:
    """One optimizer step to run: which denominator, how many microbatches, which sharding."""

    denominator: Denominator
    accum_steps: int
    shard: str = "contiguous"
    lengths: tuple[int, ...] | None = None  # response lengths of the minibatch; None: the default


_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                "broadcast", "reduce", "all_to_all", "barrier", "gather", "scatter")


@contextmanager
def count_collectives():
    """Count the torch.distributed collectives issued from Python inside the block.

    DDP's own gradient all-reduce runs inside its C++ reducer and is not counted: what this sees
    is exactly what gradnorm adds on top of DDP.
    """
    calls = {"n": 0}
    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def wrap(fn):
        def counted(*args, **kwargs):
            calls["n"] += 1
            return fn(*args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _wrap(policy: TinyPolicy, parallel_kind: str) -> nn.Module:
    if parallel_kind == "fsdp":
        # Shard the embedding and the hidden layer as their own units, then the root (the head),
        # so the check covers nested FSDP2 units as a transformer's blocks would have.
        return wrap_fsdp(policy, blocks=[policy.embed, policy.mlp])
    return nn.parallel.DistributedDataParallel(policy)


def _worker(rank: int, world_size: int, port: int, cases: list[Case], dtype: torch.dtype, out_dir: str,
            parallel_kind: str = "ddp") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # W processes share few cores
    ctx = parallel.setup(backend="gloo", device="cpu", timeout_s=120)
    try:
        wrapped = _wrap(make_policy(0, dtype), parallel_kind)
        grads, collectives = [], []
        for case in cases:
            problem = make_problem(lengths=case.lengths, dtype=dtype)
            plan = make_plan(case.shard, problem.lengths, world_size, case.accum_steps)
            wrapped.zero_grad(set_to_none=True)
            with count_collectives() as calls:
                accumulate_gradients(
                    wrapped, plan[ctx.rank], problem.mask, problem.group_ids, problem.num_groups,
                    case.denominator, lambda idx: token_losses(wrapped, problem, idx), world_size,
                )
            grads.append(flat_grad(wrapped))  # FSDP2: gathers every rank's shard (a collective)
            collectives.append(calls["n"])
        torch.save({"grads": torch.stack(grads), "collectives": torch.tensor(collectives)},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        parallel.teardown()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ddp(world_size: int, cases: list[Case], dtype: torch.dtype = torch.float64,
            parallel: str = "ddp") -> list[dict[str, Tensor]]:
    """Run ``cases`` on ``world_size`` real gloo processes; return each rank's results.

    ``results[r]["grads"][k]`` is the flat reduced gradient of ``cases[k]`` on rank r, and
    ``results[r]["collectives"][k]`` the number of collectives gradnorm issued for it. After
    DDP's all-reduce every rank holds the same gradient; the caller can check that too.
    ``parallel="fsdp"`` uses FSDP2 instead of DDP. Its own all-gathers and reduce-scatters run
    inside torch, not through the ``torch.distributed`` names patched here (as DDP's all-reduce
    runs in C++), so the count stays what gradnorm adds (tests/test_fsdp.py checks it).
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world_size, free_port(), cases, dtype, out_dir, parallel),
                 nprocs=world_size, join=True)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True) for r in range(world_size)]
