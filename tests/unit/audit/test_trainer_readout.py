"""The probe's readout is exact: known per-token weights go in through a real backward, the same come out.

No trainer and no process here: the probe model runs in this process, a loss with weights chosen
by the test (random, one per token) is backpropagated microbatch by microbatch, and the head's
gradient, with the recorded inputs, goes through ``gradnorm.audit.trainer.readout.read``. The
readout must give back every weight to fp32 rounding. Controls that must fail: one token's weight
changed, and the readout without the sink row's subtraction.
"""

import pytest
import torch

from gradnorm.audit.trainer.data import dpo_data, sft_data
from gradnorm.audit.trainer.model import EOS, PAD, sink, write_probe
from gradnorm.audit.trainer.readout import ReadoutError, read, slot_table


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    data = sft_data(8)
    folder = write_probe(tmp_path_factory.mktemp("probe") / "probe", data.vocab_size)
    return data, AutoModelForCausalLM.from_pretrained(folder)


def _rows(data, eos: bool) -> list[list[int]]:
    """Each row's input ids as a trainer feeds them: the text, then EOS if the trainer appends it."""
    return [[row[0].input_id] + [s.label for s in row if not s.eos] + ([EOS] if eos else []) for row in data.rows]


def _backward(model, data, weights, microbatches, eos=True):
    """sum over tokens of w * cross-entropy, microbatch by microbatch; the records a rank would write."""
    model.zero_grad()
    forwards = []
    rows = _rows(data, eos)
    for mb in microbatches:
        T = max(len(rows[i]) for i in mb)
        x = torch.full((len(mb), T), PAD)
        for j, i in enumerate(mb):
            x[j, : len(rows[i])] = torch.tensor(rows[i])
        forwards.append(x.clone())
        logp = torch.log_softmax(model(input_ids=x).logits.double(), -1)  # (n, T, V)
        for j, i in enumerate(mb):
            n = len(rows[i]) - 1  # positions with a label
            nll = -logp[j, torch.arange(n), torch.tensor(rows[i][1:])]  # (n,)
            (weights[i, :n] * nll).sum().backward(retain_graph=True)
    grad = model.lm_head.weight.grad.detach().double().clone()
    return [{"rank": 0, "world_size": 1, "forwards": forwards, "grad": grad}]


def test_hidden_state_is_one_hot_and_logits_zero(probe):
    data, model = probe
    x = torch.tensor([[4, 5, 6, EOS, PAD]])
    hidden = model.model(input_ids=x).last_hidden_state
    assert torch.equal(hidden, torch.nn.functional.one_hot(x, data.vocab_size).float())
    assert torch.equal(model(input_ids=x).logits, torch.zeros(1, 5, data.vocab_size))


def test_slots_are_distinct_pairs():
    for data in (sft_data(16), dpo_data(12)):
        ids, labels, exists = slot_table(data)
        pairs = list(zip(ids[exists].tolist(), labels[exists].tolist()))
        assert len(pairs) == len(set(pairs)), data.objective
        assert sink(data.vocab_size) not in labels[exists].tolist()


def test_readout_gives_back_known_weights(probe):
    data, model = probe
    gen = torch.Generator().manual_seed(0)
    ids, labels, exists = slot_table(data)
    weights = torch.rand(exists.shape, generator=gen, dtype=torch.float64) * exists  # (rows, T), 0 off the slots
    records = _backward(model, data, weights, [[0, 3, 5], [1, 2], [4, 6, 7]])
    out = read(data, records)
    assert out.mask.equal(exists)  # every row was fed with EOS: its EOS slot counts
    torch.testing.assert_close(out.values, weights, rtol=1e-6, atol=1e-9)
    assert out.stray < 1e-6
    assert [[mb.tolist() for mb in rank] for rank in out.plan] == [[[0, 3, 5], [1, 2], [4, 6, 7]]]

    changed = weights.clone()  # control: one token's weight is not what the loss gave
    changed[3, 1] *= 2
    with pytest.raises(AssertionError):
        torch.testing.assert_close(out.values, changed, rtol=1e-6, atol=1e-9)
    grad = records[0]["grad"]  # control: without the sink row's p * sum(w) the values are off
    raw = torch.where(exists, -grad[labels, ids], 0.0)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(raw, weights, rtol=1e-6, atol=1e-9)


def test_eos_slot_counts_only_when_fed(probe):
    data, model = probe
    _, _, exists = slot_table(data)
    weights = exists.double()
    rows = torch.arange(len(data.rows))
    last = torch.tensor([len(r) - 1 for r in data.rows])
    weights[rows, last] = 0.0  # no EOS label: the trainer does not append one
    out = read(data, _backward(model, data, weights, [list(range(8))], eos=False))
    assert not out.mask[rows, last].any()
    assert int(out.mask.sum()) == int(exists.sum()) - len(data.rows)


def test_a_step_before_the_whole_data_set_is_refused(probe):
    data, model = probe
    _, _, exists = slot_table(data)
    records = _backward(model, data, exists.double(), [[0, 1, 2, 3]])
    with pytest.raises(ReadoutError, match="before the trainer had read the whole probe data set"):
        read(data, records)
    with pytest.raises(ReadoutError, match="never stepped"):
        read(data, [])
