"""The audit's numeric flags have upper bounds: a seed past 2**63 or a world size that would build a
minibatch of gigabytes is one ``error:`` line and exit 2, before any loss is imported or called."""

import pytest

from gradnorm.audit.cli import main

LOSS = "gradnorm.audit.conventions:microbatch_token_mean"


@pytest.mark.parametrize("flags, says", [
    (["--seed", str(2**64)], "--seed: expected an integer in [0, 9223372036854775807]"),
    (["--seed", "-1"], "--seed: expected an integer in [0, 9223372036854775807]"),
    (["--world-size", "100000"], "--world-size: expected an integer in [1, 4096]"),
    (["--accum-steps", "10**9"], "--accum-steps: expected an integer in [1, 4096]"),
    (["--max-new-tokens", "100000000"], "--max-new-tokens: expected an integer in [1, 65536]"),
    (["--world-size", "4001", "4003", "4007"], "ask for a minibatch of"),  # the lcm of the layouts: 10**11 sequences
    (["--pack", "100000000"], "more than 10000000 in all; pack into shorter rows"),  # it allocated 10 GB in 30 s
    # every microbatch is cut into P pipeline microbatches: P multiplies the sequences (it asked for 512 GB)
    (["--pipeline-combine", "sum", "--pipeline-microbatches", "1000000000"], "--accum-steps x --pipeline-microbatches x"),
    (["--timeout", "0"], "--timeout: expected seconds in (0, 86400]"),
])
def test_out_of_range_flags_are_one_line_and_exit_2(flags, says, capsys):
    assert main([LOSS, *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith("error: ") and says in err, err
