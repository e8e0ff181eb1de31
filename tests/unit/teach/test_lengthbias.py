"""Length bias (``gradnorm.teach.lengthbias``): how each exact denominator weighs long and short responses.

Every view is checked on a case small enough to do on paper, with its control: equal lengths make
the length bias of ``sequence`` disappear.
"""

from fractions import Fraction

import pytest
from numpy.testing import assert_allclose

from gradnorm.teach import lengthbias

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


def fractions(weights):
    return [Fraction(float(w)).limit_denominator(10_000) for w in weights]


def test_length_weights_by_hand():
    # One prompt group of 4 responses with 4, 8, 12, 16 tokens (N = 40), another with 8 tokens each (N = 32).
    view = lengthbias.length_weights([4, 8, 12, 16, 8, 8, 8, 8], group_size=4, max_new_tokens=20)
    assert fractions(view.token_weight["token"]) == [Fraction(1, 72)] * 8
    assert fractions(view.token_weight["sequence"])[:4] == [Fraction(1, 32), Fraction(1, 64), Fraction(1, 96),
                                                           Fraction(1, 128)]
    assert fractions(view.token_weight["group"]) == [Fraction(1, 80)] * 4 + [Fraction(1, 64)] * 4
    assert fractions(view.token_weight["constant"]) == [Fraction(1, 160)] * 8
    assert_allclose(view.share("sequence"), 1 / 8)
    assert_allclose(view.group_share("group"), [0.5, 0.5])
    assert_allclose(view.group_share("token"), [40 / 72, 32 / 72])
    assert_allclose(view.share("constant"), view.share("token"))


def test_staircase_lengths():
    assert lengthbias.staircase_lengths(2, 3, 4) == [4, 8, 12, 8, 16, 24]


def test_correct_vs_wrong_by_hand():
    # 4 correct of 10 tokens and 4 wrong of 40; rewards 1/0 give advantages +a and -a.
    view = lengthbias.correct_vs_wrong(10, 40, num_correct=4, group_size=8, max_new_tokens=64)
    a = view.advantage_correct
    assert view.advantage_wrong == pytest.approx(-a)
    # token: w = 1/N, so the push in units of 1/N is the advantage itself
    assert view.push_per_token["token"] == pytest.approx((a, -a))
    # sequence: w = 1/(S |o_i|), times N = 200: 200/80 for a correct token, 200/320 for a wrong one
    up, down = view.push_per_token["sequence"]
    assert up == pytest.approx(a * 200 / 80) and down == pytest.approx(-a * 200 / 320)
    assert abs(down) / up == pytest.approx(0.25)  # the length bias: 10 / 40
    assert view.push_per_token["constant"] == pytest.approx((a * 200 / 512, -a * 200 / 512))
    assert view.update_share["token"] == pytest.approx((0.2, 0.8))  # 40 of 200 tokens are correct
    assert view.update_share["sequence"] == pytest.approx((0.5, 0.5))
    # control: with equal lengths the length bias disappears
    even = lengthbias.correct_vs_wrong(20, 20, num_correct=4)
    up, down = even.push_per_token["sequence"]
    assert abs(down) / up == pytest.approx(1.0)
    with pytest.raises(ValueError):
        lengthbias.correct_vs_wrong(10, 40, num_correct=0)


def test_correct_vs_wrong_without_std_scaling():
    view = lengthbias.correct_vs_wrong(10, 10, num_correct=2, group_size=8, scale_by_std=False)
    assert view.advantage_correct == pytest.approx(0.75) and view.advantage_wrong == pytest.approx(-0.25)


def test_batch_dependence():
    view = lengthbias.batch_dependence([4, 16, 64], own_length=16, num_sequences=16, group_size=4, max_new_tokens=64)
    assert_allclose(view.token_weight["token"], [1 / (16 + 15 * 4), 1 / 256, 1 / (16 + 15 * 64)])
    assert_allclose(view.token_weight["sequence"], 1 / (16 * 16))
    assert_allclose(view.token_weight["constant"], 1 / (16 * 64))
    assert_allclose(view.token_weight["group"], [1 / (4 * (16 + 3 * 4)), 1 / (4 * 64), 1 / (4 * (16 + 3 * 64))])
