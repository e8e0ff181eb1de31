"""Scoring responses in chunks of similar length gives the full-width result inside the response mask.

The reference is the plain full-width ``response_logprobs``; the chunked one must match it on
every masked position (values and the gradient of a masked loss), whatever the row order, and
be zero on the columns a chunk drops (outside the mask). TinyGPT's ``logits_to_keep`` must be
the tail of the full logits.
"""

import pytest
import torch
from torch.testing import assert_close

from gradnorm.core.denominators import mask_from_lengths
from gradnorm.models.tinygpt import GPTConfig, TinyGPT, response_logprobs
from gradnorm.trainer.chunks import length_chunks, score_by_length

P, R, V = 4, 12, 11


def ragged_batch(n=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(V, (n, P + R), generator=g)
    lengths = torch.randint(1, R + 1, (n,), generator=g)
    lengths[3] = R  # one row uses the full width
    return tokens, lengths


def model(seed=0):
    torch.manual_seed(seed)
    return TinyGPT(GPTConfig(V, P + R, n_layer=2, n_head=2, n_embd=16)).double()


def test_chunks_partition_the_rows_and_follow_the_cost_of_padding():
    _, lengths = ragged_batch(200)
    chunks = length_chunks(lengths, P, max_chunks=4, overhead_rows=4)
    assert len(chunks) > 1  # ragged rows: chunking pays
    assert sorted(torch.cat(chunks).tolist()) == list(range(200))  # every row exactly once
    maxima = [int(lengths[c].max()) for c in chunks]
    assert maxima == sorted(maxima) and all(int(lengths[b].min()) >= int(lengths[a].max())
                                            for a, b in zip(chunks, chunks[1:]))  # sorted by length
    equal = torch.full((200,), 7)
    assert len(length_chunks(equal, P)) == 1  # nothing to skip: one forward
    assert len(length_chunks(lengths[:5], P, overhead_rows=16)) == 1  # too few rows to pay for a call


def test_logits_to_keep_is_the_tail_of_the_full_logits():
    m = model()
    tokens, _ = ragged_batch(6)
    assert_close(m(tokens, logits_to_keep=5), m(tokens)[:, -5:], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("max_chunks", [2, 4])
def test_chunked_scores_and_gradients_equal_the_full_width_ones_inside_the_mask(max_chunks):
    tokens, lengths = ragged_batch()
    mask = mask_from_lengths(lengths, R)
    weights = torch.rand(len(tokens), R, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    results = {}
    for name in ("full", "chunked"):
        m = model()
        if name == "full":
            logp, entropy = response_logprobs(m, tokens, P)
        else:
            assert len(length_chunks(lengths, P, max_chunks)) > 1  # the test really chunks
            logp, entropy = score_by_length(response_logprobs, m, tokens, P, lengths, max_chunks)
        (torch.where(mask, weights * logp, 0.0)).sum().backward()
        results[name] = (logp.detach(), entropy.detach(), [p.grad.clone() for p in m.parameters()])
    (full_logp, full_entropy, full_grads), (logp, entropy, grads) = results["full"], results["chunked"]
    assert_close(logp[mask], full_logp[mask], rtol=1e-12, atol=1e-12)
    assert_close(entropy[mask], full_entropy[mask], rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, full_grads):
        assert_close(got, want, rtol=1e-10, atol=1e-12)
    # the dropped columns are zeros, and they are exactly the ones past some row's chunk width
    assert (logp[~mask] == 0).sum() > 0 and not (full_logp[~mask] == 0).any()


def test_a_chunk_must_put_rows_back_in_place():
    """The control: scores of the right values in the wrong rows fail the comparison above."""
    tokens, lengths = ragged_batch()
    mask = mask_from_lengths(lengths, R)
    m = model()
    full_logp, _ = response_logprobs(m, tokens, P)
    shuffled = score_by_length(lambda mdl, t, p: response_logprobs(mdl, t.flip(0), p), m, tokens, P, lengths)[0]
    assert not torch.allclose(shuffled[mask], full_logp[mask])
