"""The statistics behind the benchmark's claims (no timing here: the numbers are made up on purpose).

``benchmarks/fixcost.py`` turns paired rounds into a ratio of medians with a bootstrap 95%
interval, and the README's numbers are copied between markers by ``bench.py --readme``; the
race against TRL skips with one line when TRL is missing.
"""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import fixcost  # noqa: E402


def test_bootstrap_ratio_of_paired_rounds():
    local = [1.0, 1.2, 0.9, 1.1, 1.0, 1.3, 0.8, 1.0]
    same = fixcost.bootstrap_ratio(local, local)
    assert same["ratio"] == same["ci_low"] == same["ci_high"] == 1.0  # pairs move together: no doubt at all
    doubled = fixcost.bootstrap_ratio([2 * t for t in local], local)
    assert doubled["ratio"] == pytest.approx(2.0) and doubled["ci_low"] == pytest.approx(2.0)
    # noise that is not shared by the pair widens the interval around the point estimate
    noisy = fixcost.bootstrap_ratio([1.0, 1.5, 0.7, 1.2, 0.9, 1.6, 0.8, 1.1], local)
    assert noisy["ci_low"] < noisy["ratio"] < noisy["ci_high"]
    assert noisy == fixcost.bootstrap_ratio([1.0, 1.5, 0.7, 1.2, 0.9, 1.6, 0.8, 1.1], local)  # fixed seed
    with pytest.raises(ValueError):
        fixcost.bootstrap_ratio([1.0], [1.0, 2.0])


def test_fix_cost_is_a_share_of_the_median_local_step():
    pieces = {name: {"median_us": us, "p90_us": 2 * us, "n": 5} for name, us in
              [("counts_allreduce", 100.0), ("weights_token", 30.0), ("weights_local", 20.0), ("weights_overhead", 10.0)]}
    cost = fixcost.fix_cost_report(pieces, {"local": [0.010, 0.011, 0.009], "token": [0.010, 0.011, 0.009]})
    assert cost["fix_us"] == 110.0 and cost["fix_pct_of_step"] == pytest.approx(1.1)
    assert cost["pieces"]["counts_allreduce"]["pct_of_step"] == pytest.approx(1.0)
    assert "1.000 (bootstrap 95% CI 1.000 to 1.000, 3 paired rounds)" in fixcost.summary_sentence(cost)


def test_readme_block_is_replaced_between_its_markers(tmp_path):
    import bench

    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{bench.README_BEGIN}\nold numbers\n{bench.README_END}\nafter\n")
    bench.update_readme(readme, "new numbers")
    assert readme.read_text() == f"intro\n{bench.README_BEGIN}\nnew numbers\n{bench.README_END}\nafter\n"
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit, match="no .* block"):
        bench.update_readme(readme, "x")


@pytest.mark.launch
def test_the_trl_race_skips_with_one_line_without_trl(tmp_path):
    # a sitecustomize that hides trl, as on a machine without the bench extra
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['trl'] = None\n")
    proc = subprocess.run([sys.executable, str(BENCH / "vs_trl.py"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, env={"PYTHONPATH": str(tmp_path), "PATH": ""}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1 and "skipped, TRL is not installed" in proc.stdout
    assert not (tmp_path / "out").exists()
