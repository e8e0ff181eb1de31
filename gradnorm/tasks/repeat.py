"""The built-in task: "repeat a letter n times", with a reward computed from the tokens alone.

Why this task: it needs no download, its answer is checkable exactly, and its correct responses
vary in length by a factor of 8.5 (n = 1..16 letters, plus EOS: 2..17 tokens). Ragged response
lengths are the whole point of the project: they make microbatch token counts unequal, which is
exactly when a mean of per-microbatch means differs from the true token mean.

    prompt   BOS c 0 7 =            (always 5 tokens: a letter, n as two digits, '=')
    answer   c c c c c c c EOS      (then PAD up to max_new_tokens)

The tokenizer is character level; PAD, BOS and EOS are special ids that no character maps to.
"""

from dataclasses import dataclass, field
from typing import ClassVar, Sequence

import torch


class CharTokenizer:
    """Character-level tokenizer: ids 0..2 are PAD, BOS, EOS; then one id per character."""

    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    _num_special: int = 3

    def __init__(self, chars: str):
        if len(set(chars)) != len(chars):
            raise ValueError(f"duplicate characters in {chars!r}")
        self.chars = chars
        self._id_of = {c: i + self._num_special for i, c in enumerate(chars)}

    @property
    def vocab_size(self) -> int:
        return self._num_special + len(self.chars)

    def encode(self, text: str) -> list[int]:
        """Ids of the characters of ``text``; adds no special tokens."""
        try:
            return [self._id_of[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the vocabulary {self.chars!r}") from None

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Text of ``ids``: stops at the first EOS, skips PAD and BOS."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        out = []
        for i in ids:
            if i == self.eos_id:
                break
            if i >= self._num_special:
                out.append(self.chars[i - self._num_special])
        return "".join(out)


@dataclass
class RepeatTask:
    """Write the letter c exactly n times, then EOS."""

    n_min: int = 1
    """Smallest repeat count (>= 1)."""
    n_max: int = 16
    """Largest repeat count (<= 99, it is written with two digits). Correct responses, EOS
    included, span n_min + 1 .. n_max + 1 tokens: 2..17 by default, a factor of 8.5."""
    letters: str = "abcdefgh"
    """The letters a prompt may ask for."""
    max_new_tokens: int = 20
    """Response budget of the sampler. Larger than n_max + 1 so that a too-long answer can still
    end with EOS, and a response that never stops gets truncated (and penalized)."""
    counts: tuple[int, ...] = ()
    """The repeat counts a prompt may ask for, drawn uniformly; () draws every n in n_min..n_max."""

    tokenizer: CharTokenizer = field(init=False, repr=False)
    """Derived: letters, digits and '='."""
    max_reward: ClassVar[float] = 1.0
    """The reward of an exactly correct, EOS-terminated response."""

    def __post_init__(self):
        if not 1 <= self.n_min <= self.n_max <= 99:
            raise ValueError(f"need 1 <= n_min <= n_max <= 99, got {self.n_min}, {self.n_max}")
        if self.max_new_tokens < self.n_max + 1:
            raise ValueError(f"max_new_tokens {self.max_new_tokens} cannot hold n_max letters + EOS")
        if not all(self.n_min <= n <= self.n_max for n in self.counts):
            raise ValueError(f"counts {self.counts} must lie in n_min..n_max = {self.n_min}..{self.n_max}")
        if not self.letters or not all(c.isalpha() for c in self.letters):
            raise ValueError(f"letters must be non-empty letters, got {self.letters!r}")
        self.tokenizer = CharTokenizer(self.letters + "0123456789=")

    # Sizes a model and a trainer need.
    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def prompt_len(self) -> int:
        """P: BOS, letter, two digits, '='."""
        return 5

    @property
    def block_size(self) -> int:
        """Longest sequence the sampler produces: P + max_new_tokens."""
        return self.prompt_len + self.max_new_tokens

    def prompt_ids(self, letter: str, n: int) -> list[int]:
        return [self.tokenizer.bos_id] + self.tokenizer.encode(f"{letter}{n:02d}=")

    def sample_prompts(self, num_prompts: int, generator: torch.Generator) -> tuple[torch.Tensor, list[str]]:
        """Random prompts (num_prompts, P) and their correct answers ("ccccccc", without EOS).

        Deterministic given the generator state; draws on the CPU (pass a CPU generator).
        """
        letter_idx = torch.randint(len(self.letters), (num_prompts,), generator=generator).tolist()
        if self.counts:
            counts = [self.counts[i] for i in torch.randint(len(self.counts), (num_prompts,), generator=generator).tolist()]
        else:
            counts = torch.randint(self.n_min, self.n_max + 1, (num_prompts,), generator=generator).tolist()
        letters = [self.letters[i] for i in letter_idx]
        prompts = torch.tensor([self.prompt_ids(c, n) for c, n in zip(letters, counts)], dtype=torch.long)
        return prompts, [c * n for c, n in zip(letters, counts)]

    def reward(self, response_ids: torch.Tensor | Sequence[Sequence[int]], answers: Sequence[str]) -> torch.Tensor:
        """Shaped reward in [0, 1] for each response, (B,) float32.

        Let body = the response tokens before the first EOS (all of them if there is none),
        L = len(body), and the answer = letter c repeated n times. Every token of the body counts,
        PAD or digit included: a token the model chose to emit is never silently free.

            hits    = number of body tokens equal to c
            letters = hits / L                    (0 if L == 0)   right letter?
            length  = min(L, n) / max(L, n)                        right length?
            stop    = 1 if the response has an EOS, else 0.5       stopped by itself?
            reward  = letters * length * stop

        reward = 1 exactly when body == c * n and EOS follows; every wrong letter, every missing
        or extra letter and a truncated response (no EOS) lowers it. The partial credit gives a
        model trained from scratch a gradient long before it ever emits a perfect answer.
        A pure function of the tokens and the answers.
        """
        if isinstance(response_ids, torch.Tensor):
            response_ids = response_ids.tolist()
        if len(response_ids) != len(answers):
            raise ValueError(f"{len(response_ids)} responses but {len(answers)} answers")
        eos = self.tokenizer.eos_id
        rewards = []
        for ids, answer in zip(response_ids, answers):
            target = self.tokenizer.encode(answer[:1])[0]
            n = len(answer)
            stopped = eos in ids
            body = ids[: ids.index(eos)] if stopped else list(ids)
            L = len(body)
            letters = sum(i == target for i in body) / L if L else 0.0
            length = min(L, n) / max(L, n)
            rewards.append(letters * length * (1.0 if stopped else 0.5))
        return torch.tensor(rewards, dtype=torch.float32)

    def demonstrations(self, num: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Correct sequences for a supervised warm-up: tokens and loss mask, both (num, P + R).

        tokens = prompt + answer + EOS + PAD..., R = max_new_tokens. loss_mask[i, t] is True for
        the answer letters and the EOS: the tokens a policy must produce. For next-token training
        predict tokens[:, 1:] from model(tokens[:, :-1]) and weight by loss_mask[:, 1:].

        A from-scratch policy learns this task very slowly by RL alone; real GRPO starts from a
        pretrained model, and a short warm-up on these demonstrations is the stand-in for that.
        """
        prompts, answers = self.sample_prompts(num, generator)
        P, R = self.prompt_len, self.max_new_tokens
        tokens = torch.full((num, P + R), self.tokenizer.pad_id, dtype=torch.long)
        loss_mask = torch.zeros(num, P + R, dtype=torch.bool)
        tokens[:, :P] = prompts
        for i, answer in enumerate(answers):
            response = self.tokenizer.encode(answer) + [self.tokenizer.eos_id]
            tokens[i, P : P + len(response)] = torch.tensor(response)
            loss_mask[i, P : P + len(response)] = True
        return tokens, loss_mask


BIMODAL_COUNTS = (1, 2, 3, 4, 13, 14, 15, 16)
"""The repeat counts of the ``bimodal`` task: half the prompts short (1-4 letters), half long (13-16)."""

BUILTIN_TASKS = ("repeat", "bimodal")
"""The built-in tasks --task names (``builtin_task``)."""


def builtin_task(name: str, max_new_tokens: int = 20) -> RepeatTask:
    """The built-in task ``name``: ``repeat`` (n uniform in 1..16) or ``bimodal``.

    ``bimodal`` asks for 1-4 or 13-16 letters, half and half: its hard, rewarded cases need long
    responses, and the short ones are cheap. Sorting ranks by length (--shard length) then puts
    the long responses in the microbatches with the most tokens, where a per-microbatch mean
    (``local``) gives each of their tokens a fraction of the weight of a short response's token.
    """
    if name == "repeat":
        return RepeatTask(max_new_tokens=max_new_tokens)
    if name == "bimodal":
        return RepeatTask(max_new_tokens=max_new_tokens, counts=BIMODAL_COUNTS)
    raise ValueError(f"unknown built-in task {name!r}: expected one of {', '.join(BUILTIN_TASKS)}")
