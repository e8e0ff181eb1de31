"""gradnorm's GRPO drop-in (examples/drop_in_ddp.py's ``accumulate``, unchanged) in a DDP loop over the probe's
sampled completions, as a build function for the trainer audit.

    python -m gradnorm.audit --trainer examples/trainers/drop_in_grpo.py:drop_in_grpo --objective grpo        # token
    python -m gradnorm.audit --trainer examples/trainers/drop_in_grpo.py:drop_in_grpo_local --objective grpo  # SKEWED

One optimizer step: every rank samples the same batch (the first S/2 probe prompts, two completions each,
``model.generate`` under one seed), rewards it with the probe's reward, centers each group's rewards and
divides by their std + 1e-4 (TRL's advantages, which the probe's readout assumes), cuts it into this rank's A
microbatches with the drop-in's own ``microbatches_of`` (sorted by response length: the microbatches' counts
differ as much as they can) and calls ``accumulate`` with ``denominator="token"`` (the fix) or ``"local"`` (a
microbatch's own mean, the control).
"""

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: drop_in_ddp
sys.path.insert(0, str(Path(__file__).resolve().parent))  # examples/trainers/: loops

from loops import process_group  # noqa: E402  (after the paths above)

MAX_NEW_TOKENS = 64  # a cut completion (no EOS) has probability 0.75**63 at the probe's EOS rate


class _Logits(nn.Module):
    """The drop-in's policy: ``model(tokens)`` returns logits (a causal LM returns an output object)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


class _DropInGRPO:
    def __init__(self, model, tokenizer, train_dataset, reward_func, num_generations, accum_steps, completions,
                 denominator, seed):
        process_group()
        self.model, self.tokenizer, self.reward_func = model, tokenizer, reward_func
        self.G, self.accum_steps, self.denominator, self.seed = num_generations, accum_steps, denominator, seed
        self.prompts = [r["prompt"] for r in train_dataset][: completions // num_generations]

    def _batch(self) -> dict:
        """The step's S completions, on every rank the same: tokens (S, P + T + 1), mask (S, P + T) over the labels."""
        tok = self.tokenizer
        prompts = torch.tensor([tok(p)["input_ids"] for p in self.prompts]).repeat_interleave(self.G, dim=0)  # (S, P)
        torch.manual_seed(self.seed)  # the same on every rank: every rank samples the whole batch
        tokens = self.model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                                     max_new_tokens=MAX_NEW_TOKENS, eos_token_id=tok.eos_token_id,
                                     pad_token_id=tok.pad_token_id, top_k=0, top_p=1.0, temperature=1.0)
        P, responses = prompts.shape[1], tokens[:, prompts.shape[1]:]  # (S, T)
        ended = (responses == tok.eos_token_id).cumsum(-1)
        kept = (ended == 0) | ((ended == 1) & (responses == tok.eos_token_id))  # up to and including the first EOS
        lengths = kept.sum(-1)  # (S,)
        texts = [tok.decode(r[: int(n)][r[: int(n)] != tok.eos_token_id]) for r, n in zip(responses, lengths)]
        rewards = torch.tensor(self.reward_func(self.prompts, texts), dtype=torch.float64).view(-1, self.G)
        advantages = ((rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-4)).flatten()
        tokens = torch.where(torch.cat([torch.ones(len(tokens), P, dtype=torch.bool), kept], 1), tokens,
                             tok.pad_token_id)
        # one PAD column past the longest row: the drop-in feeds tokens[:, :-1], and so every label is in the input
        tokens = torch.cat([tokens, torch.full_like(tokens[:, :1], tok.pad_token_id)], 1)
        mask = torch.zeros(len(tokens), tokens.shape[1] - 1, dtype=torch.bool)  # label t is token t + 1
        for i, n in enumerate(lengths.tolist()):
            mask[i, P - 1: P - 1 + n] = True
        return {"tokens": tokens, "mask": mask, "advantages": advantages,
                "group_ids": torch.arange(len(tokens)) // self.G}

    def train(self):
        import torch.distributed as dist
        from drop_in_ddp import accumulate, microbatches_of, token_logprobs

        policy = _Logits(self.model)
        batch = self._batch()
        with torch.no_grad():  # on policy: the sampling policy's log-probs are the current ones
            batch["old_logp"] = token_logprobs(policy, batch["tokens"])
        ddp = nn.parallel.DistributedDataParallel(policy)
        optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        microbatches = microbatches_of(batch, dist.get_rank(), dist.get_world_size(), self.accum_steps)
        accumulate(ddp, microbatches, len(self.prompts), denominator=self.denominator)
        optimizer.step()
        optimizer.zero_grad()


def drop_in_grpo(model, tokenizer, train_dataset, reward_func, num_generations, *, world_size, accum_steps,
                 per_device_batch):
    return _DropInGRPO(model, tokenizer, train_dataset, reward_func, num_generations, accum_steps,
                       world_size * accum_steps * per_device_batch, "token", seed=world_size * accum_steps - 1)


def drop_in_grpo_local(model, tokenizer, train_dataset, reward_func, num_generations, *, world_size, accum_steps,
                       per_device_batch):
    return _DropInGRPO(model, tokenizer, train_dataset, reward_func, num_generations, accum_steps,
                       world_size * accum_steps * per_device_batch, "local", seed=world_size * accum_steps - 1)
