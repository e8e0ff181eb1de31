"""Probe data sets: strong, known imbalance, and an id of its own for every position.

Each data set is a list of rows (an SFT text, a DPO pair's chosen or rejected response), and each
row a list of **slots**: a (input id, label id) pair, the token the loss predicts at one position.
Content ids are handed out in order, one per position, so a slot names one token of one row, and
``gradnorm.audit.trainer.readout`` reads its weight out of the probe head's gradient. The last slot of a
row predicts EOS from the row's last id; whether it counts depends on whether the trainer appends
EOS, which the recorded inputs say (``Slot.eos``).

Lengths are ragged on purpose (1 to 24 labels, shuffled with a fixed seed), so that any split into
ranks and microbatches holds unequal counts, and a per-microbatch mean cannot hide.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from gradnorm.audit.trainer.model import EOS, FIRST_CONTENT, token_text, vocab_size_for

RAGGED = (1, 24, 2, 17, 3, 12, 5, 20, 1, 9, 14, 4, 22, 2, 7, 11, 1, 16, 6, 24, 3, 10, 13, 2)
"""Label counts the data sets cycle through: 1 to 24, in an order that puts long and short side by side."""


@dataclass(frozen=True)
class Slot:
    """One token the loss may weigh: the label ``label`` predicted at a position whose input id is ``input_id``."""

    input_id: int
    label: int

    @property
    def eos(self) -> bool:
        return self.label == EOS


@dataclass
class ProbeData:
    """A probe data set: what the trainer reads (``records``) and what the readout needs (``rows``).

    ``rows[i]`` is row i's slots; ``units[i]`` the unit row i belongs to (an SFT row is its own unit,
    a DPO pair's two rows share one); ``owner`` maps every content id to its unit.
    """

    objective: str  # "sft", "dpo" or "grpo"
    records: list[dict]  # one JSON object per example, in the columns the trainers read
    rows: list[list[Slot]]
    units: list[int]
    owner: dict[int, int] = field(default_factory=dict)
    vocab_size: int = 256

    @property
    def num_units(self) -> int:
        return max(self.units) + 1

    def write_jsonl(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        return path


def _words(ids: list[int]) -> str:
    return " ".join(token_text(i) for i in ids)


class _Ids:
    """Hands out content ids in order, remembering which unit each belongs to."""

    def __init__(self):
        self.next, self.owner = FIRST_CONTENT, {}

    def take(self, n: int, unit: int) -> list[int]:
        ids = list(range(self.next, self.next + n))
        self.next += n
        self.owner.update(dict.fromkeys(ids, unit))
        return ids


def _slots(context: int, ids: list[int]) -> list[Slot]:
    """Slots of a response ``ids`` that follows the id ``context``: each id predicted, then EOS."""
    prev = [context, *ids]
    return [Slot(prev[j], ids[j]) for j in range(len(ids))] + [Slot(prev[-1], EOS)]


def sft_data(num_sequences: int = 16, seed: int = 0) -> ProbeData:
    """SFT on plain text: row i is ``t<a> t<a+1> ...``, 1 + n_i ids; every id after the first is a label.

    Records: ``{"text": ...}`` (a causal LM trained on every token of the text, as transformers'
    Trainer and TRL's SFTTrainer read a language-modeling data set).
    """
    lengths = _lengths(num_sequences, seed)
    ids, records, rows = _Ids(), [], []
    for i, n in enumerate(lengths):
        text = ids.take(1 + n, unit=i)
        records.append({"text": _words(text)})
        rows.append(_slots(text[0], text[1:]))
    return ProbeData("sft", records, rows, list(range(num_sequences)), ids.owner, vocab_size_for(ids.next))


def dpo_data(num_pairs: int = 12, seed: int = 0) -> ProbeData:
    """Preference pairs of ragged lengths: a 2-id prompt, chosen and rejected responses of 1 to 24 ids each.

    Records: ``{"prompt", "chosen", "rejected"}`` (TRL's standard preference format). Rows 2p and
    2p + 1 are pair p's chosen and rejected responses, the order ``gradnorm.audit`` uses.
    """
    lengths = _lengths(2 * num_pairs, seed)
    ids, records, rows, units = _Ids(), [], [], []
    for p in range(num_pairs):
        prompt = ids.take(2, unit=p)
        chosen, rejected = ids.take(lengths[2 * p], unit=p), ids.take(lengths[2 * p + 1], unit=p)
        records.append({"prompt": _words(prompt), "chosen": " " + _words(chosen), "rejected": " " + _words(rejected)})
        rows += [_slots(prompt[-1], chosen), _slots(prompt[-1], rejected)]
        units += [p, p]
    return ProbeData("dpo", records, rows, units, ids.owner, vocab_size_for(ids.next))


def grpo_prompts(num_prompts: int = 16) -> ProbeData:
    """GRPO's prompts: two ids of their own each; the trainer samples the completions (``gradnorm.audit.trainer.generated``).

    Records: ``{"prompt", "answer"}`` (TRL reads the prompt and hands the answer to the reward as a keyword;
    gradnorm's trainer needs both in its prompts file). ``rows`` are the prompts (the readout learns the
    completions from the recorded inputs), ``owner`` maps each prompt's last id to its prompt index.
    """
    ids, records, rows = _Ids(), [], []
    for p in range(num_prompts):
        prompt = ids.take(2, unit=p)
        records.append({"prompt": _words(prompt), "answer": "odd"})
        rows.append([Slot(prompt[0], prompt[1])])
    vocab = 1024  # room for the completions' content ids: a sampled (input, label) pair repeats rarely
    return ProbeData("grpo", records, rows, list(range(num_prompts)), ids.owner, max(vocab, vocab_size_for(ids.next)))


def parity_reward(prompts=None, completions=None, **kwargs) -> list[float]:
    """The GRPO probe's reward (TRL's reward-function signature): 1.0 for a completion of an odd number of tokens.

    With two completions a prompt, a group's rewards are {0, 1} (advantages +-c, the same c in every
    group whatever the std scaling) or equal (advantages 0: that group's tokens carry no gradient).
    """
    return [float(len(str(c).split()) % 2) for c in completions]


def parity_of_response(response: str, answer: str) -> float:
    """``parity_reward`` in the signature of gradnorm's trainer (``--reward module:function``: one decoded response,
    up to its first EOS, and the prompt's answer): 1.0 for a response of an odd number of tokens."""
    return parity_reward(None, [response])[0]


def _lengths(n: int, seed: int) -> list[int]:
    lengths = [RAGGED[i % len(RAGGED)] for i in range(n)]
    random.Random(seed).shuffle(lengths)
    return lengths
