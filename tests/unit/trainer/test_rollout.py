"""Per-sequence sampling and sharded rollouts: a sequence's tokens do not depend on its batch.

What must hold:
- inverse-CDF sampling draws token v with probability softmax(z)[v] (a longhand check of the bins
  and a frequency check), and temperature 0 is greedy whatever the uniforms;
- sequence i samples the same tokens alone, inside larger batches and in any order, given its own
  row of uniforms (TinyGPT, one thread); the control: the old batch-level generator, whose noise
  depends on the row's place in the batch, fails that same check; greedy decoding uses no noise;
- dropping finished rows from the decode batch changes no token: on a batch whose rows
  stop at ragged steps, the shrinking loop samples exactly what the loop that keeps every row
  samples, with and without the KV cache, while its forward passes really run on fewer rows; a
  rank whose rows have all finished keeps stepping on one row while the reduce says others run;
- sharded generation on 2 real gloo ranks, with one rank's sequences all ending at once and the
  other's never, and with uneven and empty shares of the groups, assembles the global batch that
  one process samples, bit for bit; under FSDP2 both ranks decode the same number of steps (the
  lock-step that keeps FSDP's collective forward from hanging), without it the early rank stops;
- non-finite logits raise NonFiniteLogitsError (a ValueError the trainer turns into one line);
- --rollouts takes sharded or replicated, anything else is a one-line error and exit code 2.
"""

import pytest
import torch
from torch.testing import assert_close

from gradnorm.dist import wrap
from gradnorm.dist.spawn import spawn_gloo
from tests.helpers.decoding import decode_batch_sizes
from gradnorm.trainer.policy import TinyGPTPolicy
from gradnorm.trainer.rollout import generate_rollout, group_split, sequence_uniforms
from gradnorm.models.sampling import NonFiniteLogitsError, decode, sample_next
from gradnorm.tasks import CharTokenizer, RepeatTask
from gradnorm.models.tinygpt import GPTConfig, KVCache, TinyGPT, generate

V, P, R = 21, 5, 20
PAD, EOS = 0, 2


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # the trainer's setting: thread counts change matmul rounding
    yield
    torch.set_num_threads(previous)


def make_model(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(GPTConfig(vocab_size=V, block_size=P + R))


# ------------------------------------------------------------------ the draw


def test_inverse_cdf_picks_the_bin_that_holds_u_and_matches_the_probabilities():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    logits = probs.log()[None].expand(6, 4)  # -inf for the impossible token 1
    u = torch.tensor([0.0, 0.05, 0.1001, 0.69, 0.7001, 0.9999])
    assert sample_next(logits, 1.0, u).tolist() == [0, 0, 2, 2, 3, 3]  # longhand: cdf = .1, .1, .7, 1
    # Frequencies over many uniforms: within 5 binomial standard deviations of the probabilities.
    z = torch.randn(1, V, generator=torch.Generator().manual_seed(0))
    n = 40_000
    draws = sample_next(z.expand(n, V), 0.7, torch.rand(n, generator=torch.Generator().manual_seed(1)))
    p = torch.softmax(z[0] / 0.7, -1)
    freq = torch.bincount(draws, minlength=V) / n
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-4).all()
    assert sample_next(z.expand(3, V), 0.0, torch.rand(3)).tolist() == [int(z.argmax())] * 3  # greedy


def test_greedy_decoding_ignores_the_noise_and_leaves_the_global_rng_alone():
    model = make_model()
    prompts = torch.randint(3, V, (4, P), generator=torch.Generator().manual_seed(0))
    state = torch.get_rng_state()
    greedy = generate(model, prompts, R, EOS, PAD, temperature=0.0)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(generate(model, prompts, R, EOS, PAD, temperature=0.0, uniforms=torch.rand(4, R)), greedy)


def sample_rows(model, prompts, uniforms):
    return generate(model, prompts, R, EOS, PAD, uniforms=uniforms)[:, P:]


def test_a_sequence_samples_the_same_tokens_alone_and_in_any_batch():
    model = make_model()
    prompts = torch.randint(3, V, (12, P), generator=torch.Generator().manual_seed(0))
    uniforms = sequence_uniforms(range(12), R, 0, "sample", 1)  # (12, R): row i from (0, "sample", 1, i)
    batch = sample_rows(model, prompts, uniforms)
    assert len({tuple(r) for r in batch.tolist()}) > 6  # the rows really differ: a test that can fail
    for i in (0, 5, 11):
        alone = sample_rows(model, prompts[i : i + 1], uniforms[i : i + 1])
        assert torch.equal(alone[0], batch[i]), i
    order = torch.randperm(12, generator=torch.Generator().manual_seed(2))
    assert torch.equal(sample_rows(model, prompts[order], uniforms[order]), batch[order])
    assert torch.equal(sample_rows(model, prompts[3:7], uniforms[3:7]), batch[3:7])
    # A row's noise is its own: drawing rows 3..6 alone gives the same uniforms as inside 0..11.
    assert torch.equal(sequence_uniforms(range(3, 7), R, 0, "sample", 1), uniforms[3:7])


def test_control_the_old_batch_level_generator_ties_a_sequence_to_its_place_in_the_batch():
    model = make_model()
    prompts = torch.randint(3, V, (12, P), generator=torch.Generator().manual_seed(0))

    def old(rows):  # one (seed, step) generator for the whole batch, as before sharding
        return generate(model, prompts[rows], R, EOS, PAD, generator=torch.Generator().manual_seed(7))[:, P:]

    batch = old(slice(0, 12))
    moved = sum(not torch.equal(old(slice(i, i + 1))[0], batch[i]) for i in range(1, 12))
    assert moved >= 8, moved  # alone, most sequences sample other tokens than in the batch
    assert torch.equal(old(slice(0, 12)), batch)  # while the batch itself is reproducible


class CountPrefill(TinyGPT):
    """TinyGPT that records the rows of its prefill call (the first call on an empty cache)."""

    prefill_rows: list[int] = []

    def forward(self, idx, kv_cache=None, **kwargs):
        if kv_cache is not None and kv_cache.pos == 0:
            self.prefill_rows.append(idx.shape[0])
        return super().forward(idx, kv_cache, **kwargs)


def test_a_groups_shared_prompt_is_prefilled_once_and_changes_no_token(monkeypatch):
    from gradnorm.models import sampling, tinygpt

    model = make_model()
    model.__class__ = CountPrefill
    G = 4
    prompts = torch.randint(3, V, (5, P), generator=torch.Generator().manual_seed(0)).repeat_interleave(G, dim=0)
    uniforms = sequence_uniforms(range(20), R, 0, "sample", 3)
    CountPrefill.prefill_rows = []
    grouped = sample_rows(model, prompts, uniforms)
    assert CountPrefill.prefill_rows == [5]  # 5 distinct prompts for 20 rows
    alone = torch.cat([sample_rows(model, prompts[i : i + 1], uniforms[i : i + 1]) for i in range(20)])
    assert torch.equal(grouped, alone)  # each row as if its prompt had been prefilled for it alone
    assert torch.equal(grouped, generate(model, prompts, R, EOS, PAD, uniforms=uniforms, use_cache=False)[:, P:])
    # Control: copying the wrong prefill to a row (each group's neighbour's) changes the tokens.
    first, copies = sampling.distinct_prompts(prompts)
    monkeypatch.setattr(tinygpt, "distinct_prompts", lambda p: (first, copies.roll(G)))
    assert not torch.equal(sample_rows(model, prompts, uniforms), grouped)
    monkeypatch.undo()
    distinct = torch.randint(3, V, (6, P), generator=torch.Generator().manual_seed(1))
    kept, none = sampling.distinct_prompts(distinct)
    assert kept is distinct and none is None  # all distinct: the batch goes through as it is


class BatchSizes(TinyGPT):
    """Records the batch size of every forward pass (the prefill is the first)."""

    def forward(self, idx, kv_cache=None, **kwargs):
        self.sizes.append(idx.shape[0])
        return super().forward(idx, kv_cache, **kwargs)


def test_dropping_finished_rows_changes_no_token_while_the_batch_shrinks():
    torch.manual_seed(0)
    model = BatchSizes(GPTConfig(vocab_size=V, block_size=P + R))
    with torch.no_grad():  # sharpen the attention: at init q.k is ~0, and a row would barely notice wrong keys
        for block in model.blocks:
            block.attn.qkv.weight.mul_(10)
    prompts = torch.randint(3, V, (16, P), generator=torch.Generator().manual_seed(0))
    uniforms = sequence_uniforms(range(16), R, 0, "sample", 1)
    for use_cache in (True, False):
        model.sizes = []
        kept = generate(model, prompts, R, EOS, PAD, uniforms=uniforms, use_cache=use_cache, drop_finished=False)
        assert set(model.sizes) == {16}
        model.sizes = []
        dropped = generate(model, prompts, R, EOS, PAD, uniforms=uniforms, use_cache=use_cache)
        assert torch.equal(dropped, kept), use_cache
        # The rig is ragged: rows stop at several different steps and some never do.
        stops = {int((row == EOS).nonzero()[0]) if (row == EOS).any() else R for row in kept[:, P:]}
        assert len(stops) >= 4 and R in stops, stops
        # The batch shrank as rows finished, in bunches of at least DROP_AT of it.
        running = [(kept[:, P : P + t + 1] == EOS).any(-1).logical_not().sum().item() for t in range(R - 1)]
        assert model.sizes == decode_batch_sizes(16, running)[: len(model.sizes)], (model.sizes, running)
        assert model.sizes[-1] <= 8  # half the batch or less by the end


def test_a_rank_with_every_row_finished_keeps_stepping_on_one_row_in_lock_step():
    prompts = torch.randint(3, V, (3, P), generator=torch.Generator().manual_seed(0))
    says_eos = torch.full((3, V), -50.0)
    says_eos[:, EOS] = 50.0
    sizes = []

    def advance(token, t, out, keep):
        sizes.append(len(token))
        return torch.zeros(len(token), V)  # anything: the finished row's draws stay PAD

    other_rank_runs = lambda status: status + torch.tensor([1, 0])  # noqa: E731  (another rank never stops)
    out = decode(prompts, says_eos, advance, R, EOS, PAD, uniforms=torch.rand(3, R), reduce=other_rank_runs)
    assert sizes == [1] * (R - 1)  # every step, on one row
    assert (out[:, P] == EOS).all() and (out[:, P + 1 :] == PAD).all()
    sizes.clear()
    decode(prompts, says_eos, advance, R, EOS, PAD, uniforms=torch.rand(3, R))
    assert sizes == []  # alone, it stops at once


def test_group_split_is_contiguous_even_and_covers_every_group():
    assert group_split(8, 2) == [range(0, 4), range(4, 8)]
    assert group_split(5, 2) == [range(0, 3), range(3, 5)]
    assert group_split(1, 2) == [range(0, 1), range(1, 1)]
    for n in range(0, 12):
        for w in (1, 2, 3, 8):
            split = group_split(n, w)
            assert [g for r in split for g in r] == list(range(n))
            assert max(map(len, split)) - min(map(len, split)) <= 1


# ------------------------------------------------------------------ non-finite logits


def test_non_finite_logits_raise_a_named_value_error():
    model = make_model()
    with torch.no_grad():
        model.lm_head.weight[3, 0] = float("nan")
    prompts = torch.randint(3, V, (2, P), generator=torch.Generator().manual_seed(0))
    with pytest.raises(NonFiniteLogitsError, match="logits became non-finite during sampling.*lower --lr"):
        generate(model, prompts, R, EOS, PAD, uniforms=torch.rand(2, R))
    assert issubclass(NonFiniteLogitsError, ValueError)  # train.main prints ValueErrors in one line
    # -inf is a token with probability 0, not an error; +inf is.
    ok = torch.zeros(2, V)
    ok[:, 5:] = ok[:, EOS] = float("-inf")  # never EOS: every row keeps sampling
    out = decode(prompts, ok, lambda token, t, out, keep: ok, R, EOS, PAD, uniforms=torch.rand(2, R))
    assert (out[:, P:] < 5).all() and (out[:, P:] != EOS).all()
    bad = ok.clone()
    bad[1, 3] = float("inf")
    with pytest.raises(NonFiniteLogitsError):
        decode(prompts, ok, lambda token, t, out, keep: bad, R, EOS, PAD, uniforms=torch.rand(2, R))
    nothing = ok.clone()
    nothing[0] = float("-inf")  # a row where no token has any probability
    with pytest.raises(NonFiniteLogitsError):
        decode(prompts, ok, lambda token, t, out, keep: nothing, R, EOS, PAD, uniforms=torch.rand(2, R))
    nan = ok.clone()
    nan[0, 0] = float("nan")  # NaN beside finite logits and -inf
    with pytest.raises(NonFiniteLogitsError):
        decode(prompts, ok, lambda token, t, out, keep: nan, R, EOS, PAD, uniforms=torch.rand(2, R))


# ------------------------------------------------------------------ sharded generation on 2 gloo ranks


class HalfA(RepeatTask):
    """Prompts for the letter a in the first half of the groups (rank 0's share), b in the rest."""

    def sample_prompts(self, num_prompts, generator):
        counts = torch.randint(self.n_min, self.n_max + 1, (num_prompts,), generator=generator).tolist()
        first = len(group_split(num_prompts, 2)[0])
        letters = ["a" if i < first else "b" for i in range(num_prompts)]
        prompts = torch.tensor([self.prompt_ids(c, n) for c, n in zip(letters, counts)])
        return prompts, [c * n for c, n in zip(letters, counts)]


class RowFlagsCache(KVCache):
    """The rig keeps a flag per row on its cache; the flags follow the rows the decode batch keeps."""

    def keep(self, rows):
        super().keep(rows)
        self.stops = self.stops[rows]


class StopsOnA(TinyGPT):
    """Says EOS at once after a prompt for the letter a, and never EOS after any other: an uneven finish.

    ``calls`` counts forward passes, i.e. decode steps (the prefill is one of them).
    """

    calls = 0

    def new_kv_cache(self, batch_size):
        p = self.lm_head.weight
        return RowFlagsCache(self.config, batch_size, device=p.device, dtype=p.dtype)

    def forward(self, idx, kv_cache=None):
        self.calls += 1
        logits = super().forward(idx, kv_cache)
        if kv_cache is not None and kv_cache.pos == idx.shape[1]:  # the prefill: remember each row's prompt
            kv_cache.stops = idx[:, 1] == self.a_id
        logits[..., CharTokenizer.eos_id] = torch.where(kv_cache.stops, 50.0, -50.0)[:, None]
        return logits


def stops_on_a(task: HalfA) -> StopsOnA:
    torch.manual_seed(0)
    model = StopsOnA(GPTConfig(task.vocab_size, task.block_size, n_layer=1, n_embd=32))
    model.a_id = task.tokenizer.encode("a")[0]
    return model


def sharded_rollouts(ctx, cases):
    """Worker: for each (num_prompts, fsdp), the sharded rollout of step 1 and this rank's decode steps."""
    task, found = HalfA(), []
    for num_prompts, fsdp in cases:
        model = stops_on_a(task)
        if fsdp:
            wrap.wrap_fsdp(model, blocks=list(model.blocks))
        rollout = generate_rollout(TinyGPTPolicy(model), task, num_prompts=num_prompts, group_size=4, seed=5, step=1,
                                   temperature=1.0, rank=ctx.rank, world_size=ctx.world_size)
        found.append({"tokens": rollout.tokens, "rewards": rollout.rewards, "steps": model.calls})
    return found


CASES = [(3, True), (3, False), (1, True)]  # uneven shares (2 groups and 1), and rank 1 with none


@pytest.mark.launch
def test_sharded_generation_with_uneven_finish_gathers_the_one_process_batch():
    task = HalfA()
    ranks = spawn_gloo(sharded_rollouts, 2, CASES)
    for k, (num_prompts, fsdp) in enumerate(CASES):
        model = stops_on_a(task)
        single = generate_rollout(TinyGPTPolicy(model), task, num_prompts=num_prompts, group_size=4, seed=5, step=1, temperature=1.0)
        for rank in range(2):
            got = ranks[rank][k]
            assert torch.equal(got["tokens"], single.tokens), (k, rank)
            assert_close(got["rewards"], single.rewards, rtol=0, atol=0)
        responses = single.tokens[:, P:]
        if num_prompts == 3:  # the rig works: rank 0's sequences say EOS at once, rank 1's never stop
            assert (responses[:8, 0] == task.tokenizer.eos_id).all() and single.tokens.shape[1] == P + R
            assert (single.mask[8:].sum(-1) == R).all()
        steps = [ranks[rank][k]["steps"] for rank in range(2)]
        if fsdp:  # lock-step: the rank that finished first keeps stepping with the other
            assert steps[0] == steps[1] == (R if num_prompts == 3 else 1), steps
        else:  # no collective in the forward: the early rank stops after its first token
            assert steps == [1, R], steps


def test_rollouts_flag_takes_sharded_or_replicated_and_rejects_anything_else(capsys):
    from gradnorm.train import main
    from gradnorm.trainer.config import parse_config

    assert parse_config([]).rollouts == "sharded"
    assert parse_config(["--rollouts", "replicated"]).rollouts == "replicated"
    assert main(["--rollouts", "everywhere", "--output-dir", "/nonexistent/never"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --rollouts 'everywhere': expected one of sharded, replicated") and err.count("\n") == 1
