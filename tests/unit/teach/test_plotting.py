"""Drawing helpers of ``gradnorm.teach.plotting`` that the notebooks lean on, read back from their artists."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from gradnorm.teach.plotting import mark_microbatches  # noqa: E402


def test_mark_microbatches_draws_a_line_between_microbatches_and_names_each():
    rank = [0, 0, 0, 0, 0, 1, 1]  # rows in plan order: rank 0 has microbatches of 2, 1 and 2 rows
    microbatch = [0, 0, 1, 2, 2, 0, 0]
    fig, ax = plt.subplots()
    ax.set_ylim(4.5, -0.5)  # the zoom: rank 0's five rows
    starts = mark_microbatches(ax, rank, microbatch, rows=5)
    assert starts == [0, 2, 3]
    assert sorted(line.get_ydata()[0] for line in ax.lines) == [1.5, 2.5]  # between rows 1|2 and 2|3, not 4|5
    assert [t.get_text() for t in ax.texts] == ["r0/m0", "r0/m1", "r0/m2"]
    centres = [t.get_position()[1] for t in ax.texts]  # axes fraction, top row first
    assert centres == sorted(centres, reverse=True) and abs(centres[1] - 0.5) < 1e-12  # row 2 is the middle of 5
    plt.close(fig)
