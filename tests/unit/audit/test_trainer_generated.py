"""A generating trainer's readout is exact: a GRPO loss with known weights on hand-made completions comes back
mode by mode, cell by cell.

The probe (generating: EOS after any token with probability 1/4) runs in this process on completions
written by the test, two a prompt, one pair of them sharing an (input, label) cell; the loss is
-sum w * A * log p with w a mode's weights and A the probe's advantages (+-c by the parity reward).
``read_generated`` and ``fit_modes`` must find that mode at distance ~0 and factor 1; the control,
weights of each microbatch by its own count on unequal microbatches, must be far from `token`.

A trainer that forwards ``tokens[:, :-1]`` (gradnorm's) never feeds the last label of a forward's longest
rows: the readout reads it from the gradient, or, for a row whose group has no gradient, from another run of
the same trainer; read as ending at the edge instead, the batch is short of those labels (the control). The
recorder keeps a forward only when a gradient reaches its output, and groups forwards by backward.
"""

import pytest
import torch

from gradnorm.audit.objectives import GRPO, mode_weights
from gradnorm.audit.trainer.data import grpo_prompts
from gradnorm.audit.trainer import recorder
from gradnorm.audit.trainer.generated import ADVANTAGE, GeneratedReport, fit_modes, read_generated
from gradnorm.audit.trainer.model import EOS, PAD, write_probe
from gradnorm.audit.trainer.readout import ReadoutError

CONTENT = 100  # completions' ids start here, clear of the prompts'


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    data = grpo_prompts(4)
    folder = write_probe(tmp_path_factory.mktemp("probe") / "probe", data.vocab_size, generating=True)
    return data, AutoModelForCausalLM.from_pretrained(folder)


def _completions(data):
    """Two a prompt, 1 to 5 labels (EOS included), both parities in three groups and equal ones in the last
    (advantages 0); completions 0 and 2 share the cell (100 -> 101): the gradient holds their sum."""
    a = CONTENT
    return [(0, [a, a + 1, EOS]), (0, [a + 2, EOS]),          # rewards 0 (2 tokens before EOS), 1
            (1, [a, a + 1, a + 3, EOS]), (1, [a + 4, a + 5, a + 6, a + 7, EOS]),  # 1, 0; (a -> a+1) shared with 0
            (2, [EOS]), (2, [a + 8, EOS]),                    # 0, 1
            (3, [a + 9, EOS]), (3, [a + 10, EOS])]            # 1, 1: advantages 0


def _backward(model, data, completions, plan, mode, scale=1.0, constant=0.0, drop_last=False):
    """The records of a trainer that weighs each token by ``scale`` times ``mode`` (w * A * -log p, backward per
    microbatch); ``constant``: C for the mode "constant"; ``drop_last``: each forward is fed its rows but their
    last column, as gradnorm's trainer feeds ``tokens[:, :-1]`` (the last position predicts nothing)."""
    model.zero_grad()
    prompts = [[row[0].input_id, row[0].label] for row in data.rows]
    rows = [prompts[p] + tokens for p, tokens in completions]
    S, T = len(completions), max(len(t) for _, t in completions)
    mask = torch.zeros(S, T, dtype=torch.bool)
    for i, (_, tokens) in enumerate(completions):
        mask[i, : len(tokens)] = True
    groups = torch.tensor([p for p, _ in completions])
    rewards = torch.tensor([float(sum(i != EOS for i in t) % 2) for _, t in completions], dtype=torch.float64)
    adv = torch.zeros(S, dtype=torch.float64)
    for g in groups.unique():
        members = groups == g
        adv[members] = torch.sign(rewards[members] - rewards[members].mean()) * ADVANTAGE
    _, group_ids = groups.unique(return_inverse=True)
    w = scale * mode_weights(GRPO, mode, mask, group_ids, int(group_ids.max()) + 1, plan, constant)  # (S, T)
    forwards = []
    for mb in plan[0]:
        width = max(len(rows[i]) for i in mb.tolist())
        x = torch.full((len(mb), width), PAD)
        for j, i in enumerate(mb.tolist()):
            x[j, : len(rows[i])] = torch.tensor(rows[i])
        if drop_last:
            x = x[:, :-1]
        forwards.append(x.clone())
        logp = torch.log_softmax(model(input_ids=x).logits.double(), -1)
        loss = 0.0
        for j, i in enumerate(mb.tolist()):
            n = len(completions[i][1])
            labels = torch.tensor(completions[i][1])
            picked = logp[j, torch.arange(1, 1 + n), labels]  # position 1 (the prompt's last id) predicts the first
            loss = loss - (w[i, :n] * adv[i] * picked).sum()
        loss.backward()
    return [{"rank": 0, "world_size": 1, "forwards": forwards, "grad": model.lm_head.weight.grad.double().clone()}]


@pytest.mark.parametrize("mode", ["token", "sequence", "group"])
def test_a_mode_comes_back_exactly(probe, mode):
    data, model = probe
    completions = _completions(data)
    plan = [[torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5, 6, 7])]]
    run = read_generated(data, _backward(model, data, completions, plan, mode))
    assert sorted(len(c.tokens) for c in run.completions) == sorted(len(t) for _, t in completions)
    assert any(len(where) == 2 for where in run.cells.values())  # the shared cell is read as one
    fits = fit_modes(run)
    assert fits[mode].distance < 1e-6 and fits[mode].factor == pytest.approx(1, abs=1e-6)
    assert run.stray < 1e-6
    others = [m for m in ("token", "sequence", "group") if m != mode]
    assert all(fits[m].distance > 1e-2 for m in others)  # control: the other modes do not fit


def test_control_per_microbatch_means_are_not_token(probe):
    data, model = probe
    completions = _completions(data)
    plan = [[torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5, 6, 7])]]  # unequal token counts
    fits = fit_modes(read_generated(data, _backward(model, data, completions, plan, "local")))
    assert fits["local"].distance < 1e-6
    assert fits["token"].distance > 1e-2


def _two_runs(probe, first, second):
    """A report of two runs on different batches (the second lacks the last group), each weighed as told."""
    data, model = probe
    completions = _completions(data)
    runs = []
    for batch, (mode, scale, constant) in ((completions, first), (completions[:6], second)):
        plan = [[torch.arange(len(batch))]]
        runs.append(read_generated(data, _backward(model, data, batch, plan, mode, scale, constant)))
    assert runs[0].tokens != runs[1].tokens
    return GeneratedReport("test", ["first", "second"], runs, tol=1e-5)


def test_the_same_factor_in_every_run_is_the_advantages_scaling(probe):
    report = _two_runs(probe, ("token", 2 ** 0.5, 0.0), ("token", 2 ** 0.5, 0.0))
    d = report.decision()
    assert report.exit_code == 0 and d.law == "advantages" and d.factors[0] == pytest.approx(2 ** 0.5)


def test_a_constant_denominator_is_found_across_runs_of_different_n(probe):
    report = _two_runs(probe, ("constant", 1.0, 64.0), ("constant", 1.0, 64.0))
    d = report.decision()
    assert report.exit_code == 0 and d.law == "constant" and d.constant == pytest.approx(64.0)
    assert "C = 64" in report.verdict()


def test_control_a_factor_that_changes_between_runs_is_skewed(probe):
    report = _two_runs(probe, ("token", 1.0, 0.0), ("token", 1.1, 0.0))
    d = report.decision()
    assert report.exit_code == 1 and d.law == "varies" and report.verdict().startswith("SKEWED")


def test_a_label_beyond_the_forward_is_read_from_the_gradient(probe):
    """Fed ``tokens[:, :-1]``, each microbatch's longest rows lack their last label (EOS) in the input: the rows
    whose group has an advantage show it in the gradient, and the trainer is read as dropping the last column."""
    data, model = probe
    completions = _completions(data)
    plan = [[torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5, 6, 7])]]
    run = read_generated(data, _backward(model, data, completions, plan, "token", drop_last=True))
    assert run.drops is True and run.unsure == 0
    assert [c.tokens for c in run.completions] == [t for _, t in completions]
    fits = fit_modes(run)
    assert fits["token"].distance < 1e-6 and fits["token"].factor == pytest.approx(1, abs=1e-6)


def test_whole_rows_cut_at_the_maximum_end_at_the_edge(probe):
    """A trainer that feeds whole rows leaves a row at the edge only where its maximum cut it: no label lies
    beyond, and the gradient says so (the cut completion's group has an advantage)."""
    data, model = probe
    a = 100
    completions = [(0, [a, a + 1, a + 2]), (0, [a + 3, a + 7, EOS]),   # cut at 3: rewards 1, 0
                   (1, [a + 4, EOS]), (1, [a + 5, a + 6, EOS])]
    plan = [[torch.arange(4)]]
    run = read_generated(data, _backward(model, data, completions, plan, "token"))
    assert run.drops is False
    assert [c.tokens for c in run.completions] == [t for _, t in completions]
    assert fit_modes(run)["token"].distance < 1e-6


def _silent_edge(data, model, mode="token"):
    """One microbatch fed ``tokens[:, :-1]`` whose longest row is in a group of equal rewards: no gradient on it."""
    a = 100
    completions = [(0, [a, EOS]), (0, [a + 1, a + 2, EOS]),              # rewards 1, 0
                   (1, [a + 3, a + 4, a + 5, EOS]), (1, [a + 6, EOS])]   # 1, 1: advantages 0, the longest row
    return completions, _backward(model, data, completions, [[torch.arange(4)]], mode, drop_last=True)


def test_control_a_row_at_the_edge_with_no_gradient_is_unsure(probe):
    """Nothing in its run says whether a label lies beyond: read as ending at the edge, the batch lacks its EOS and
    every weight reads (N - 1) / N times `token`'s on the batch read (the control); told by another run, it reads
    exactly."""
    data, model = probe
    completions, records = _silent_edge(data, model)
    unsure = read_generated(data, records)
    assert unsure.drops is None and unsure.unsure == 1
    N = sum(len(t) for _, t in completions)
    assert unsure.tokens == N - 1
    assert fit_modes(unsure)["token"].factor == pytest.approx((N - 1) / N, rel=1e-6)  # the misread shows
    told = read_generated(data, records, drops=True)
    assert told.tokens == N and told.unsure == 0
    assert fit_modes(told)["token"].factor == pytest.approx(1, abs=1e-6)


def test_a_run_that_cannot_say_is_read_as_the_runs_that_can(probe):
    data, model = probe
    completions = _completions(data)
    plan = [[torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5, 6, 7])]]
    says = read_generated(data, _backward(model, data, completions, plan, "token", drop_last=True))
    _, records = _silent_edge(data, model)
    report = GeneratedReport("test", ["says", "silent"], [says, read_generated(data, records)], tol=1e-5)
    assert report.runs[1].unsure == 0 and report.runs[1].drops is None
    assert report.exit_code == 0 and report.decision().law == "exact"
    assert "unsure" not in report.format()


def test_a_cut_row_with_no_gradient_is_refused(probe):
    """A row at the edge of a ``tokens[:, :-1]`` forward that the trainer's maximum cut (no EOS) in a group of
    equal rewards: read as ending in EOS, its group's rewards would differ, so the readout refuses it."""
    data, model = probe
    a = 100
    completions = [(0, [a, EOS]), (0, [a + 1, a + 2, EOS]),            # 1, 0: the gradient says the column drops
                   (1, [a + 3, a + 4, a + 5, a + 6]), (1, [a + 7, a + 8, EOS])]  # cut at 4, 0; 0: advantages 0
    records = _backward(model, data, completions, [[torch.tensor([0, 1]), torch.tensor([2, 3])]], "token",
                        drop_last=True)
    with pytest.raises(ReadoutError, match="maximum length cut it"):
        read_generated(data, records, drops=True)


def test_a_row_without_its_prompt_is_refused(probe):
    """A prompt forwarded once and its completions apart (a shared KV cache): the rows cannot be placed."""
    data, model = probe
    records = _backward(model, data, _completions(data), [[torch.arange(8)]], "token")
    records[0]["forwards"].append(torch.tensor([[100, 101, EOS, PAD]]))
    with pytest.raises(ReadoutError, match="without its prompt"):
        read_generated(data, records)


def test_the_recorder_keeps_forwards_a_backward_reached_one_microbatch_per_backward(monkeypatch):
    """Forwards 0 and 2, 3 (two chunks of one microbatch) feed losses; forward 1's output is never used."""
    V = 256
    monkeypatch.setattr(recorder, "_state", dict(vocab=V, forwards=[], backward_of=[], backwards=0, last="forward",
                                                 embedding=None, done=False))
    embedding = torch.nn.Embedding(V, V)
    handle = embedding.register_forward_hook(recorder._on_forward)
    try:
        embedding(torch.tensor([[4, 5]])).sum().backward()
        embedding(torch.tensor([[6, 7]]))  # with gradients, but no loss uses it
        with torch.no_grad():
            embedding(torch.tensor([[8, 9]]))  # sampling: not recorded at all
        (embedding(torch.tensor([[10, 11]])).sum() + embedding(torch.tensor([[12, 13]])).sum()).backward()
    finally:
        handle.remove()
    forwards, microbatches = recorder._used_forwards()
    assert [f.tolist() for f in forwards] == [[[4, 5]], [[10, 11]], [[12, 13]]]
    assert microbatches == [0, 1, 1]
    assert len(recorder._state["forwards"]) == 4  # the control: the unused forward was recorded, then dropped


def test_a_dropped_label_sharing_its_cell_is_read_from_the_position_it_shares_with(probe):
    """Completion 1's dropped EOS follows id 101, as completion 0's EOS does: the cell (101 -> EOS) holds both, so
    column 101 shows no label of its own; the other microbatch's row says the trainer drops the last column."""
    data, model = probe
    a = 100
    completions = [(0, [a, a + 1, EOS]), (0, [a + 2, a + 3, a + 1, EOS]),  # rewards 0, 1; completion 1 at the edge
                   (1, [a + 4, EOS]), (1, [a + 5, a + 6, EOS])]            # 1, 0; completion 3 at the edge
    records = _backward(model, data, completions, [[torch.tensor([0, 1]), torch.tensor([2, 3])]], "token",
                        drop_last=True)
    run = read_generated(data, records)
    assert run.drops is True and run.unsure == 0
    assert [c.tokens for c in run.completions] == [t for _, t in completions]
    assert fit_modes(run)["token"].distance < 1e-6
