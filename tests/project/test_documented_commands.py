"""Every command README.md and docs/*.md show is run by a test as a user types it, or says why it cannot run here.

tests/helpers/documented.py reads the commands off the pages (the shell lines of fenced blocks and the
code spans of prose that begin with a command) and holds ``REGISTRY``: for each command, the tests that run
it as typed, or the reason it cannot run here (a GPU, several nodes, Slurm, the network, the install step
or the suite itself). The first tests check the pages against the registry, with controls: a command
added to a page without an entry, an entry whose command left the pages, an entry naming a test that does
not exist, each fails the check.

The rest run the commands that no other test ran, through bash from the repository root with the
virtual environment's bin/ first on PATH (an activated venv), each output directory the page makes up
(``runs/w1``) moved into tmp_path, and check the exit status and what the page says it prints. A
command too slow for the suite runs with the smaller flags its page names (``make demo`` with
``DEMO_FLAGS="--steps 1 ..."``). Each test reads one job of the table ``JOBS``; the jobs of the
selected tests start at the module's first, two at a time. One run of each catches a launch that fails
now and then only by chance: ``python -m tests.helpers.repeat_commands`` runs the multi-process ones
10 (the drop-in examples 20) times in a row and counts the exits.
"""

import json
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.helpers.documented import (REGISTRY, Entry, documented, fill, make_options, page_commands, problems,
                                      run_typed, shown)
from tests.helpers.skipping import skip_or_fail

COMMANDS = documented(ROOT)


def test_every_documented_command_has_a_test_or_a_reason():
    # A parser that found nothing would fail too: every entry would name a command no page shows.
    assert problems(COMMANDS, REGISTRY, ROOT) == []


def test_control_a_command_added_to_a_page_without_an_entry_fails_the_check():
    texts = {"README.md": (ROOT / "README.md").read_text()
             + "\nThen run `python -m gradnorm.report runs/grpo` and\n\n```bash\nmake release \\\n    VERSION=1\n```\n"}
    found = problems(documented(ROOT, texts), REGISTRY, ROOT)
    new = sorted(re.match(r"README\.md:\d+: `(.*)` has no entry", line)[1] for line in found if "has no entry" in line)
    assert new == ["make release VERSION=1", "python -m gradnorm.report runs/grpo"], found


def test_control_a_stale_entry_an_empty_entry_and_a_missing_test_fail_the_check():
    registry = {**REGISTRY,
                "make publish": Entry(reason="no page shows it"),
                "make demo": Entry(),
                "make example": Entry(("tests/project/test_documented_commands.py::test_that_was_renamed",
                                       "tests/nowhere.py::test_it"))}
    assert sorted(problems(COMMANDS, registry, ROOT)) == sorted([
        "REGISTRY names `make publish`, which no page shows any more",
        "REGISTRY's `make demo` names neither a test nor a reason",
        "REGISTRY's `make example` names tests/project/test_documented_commands.py::test_that_was_renamed, "
        "which is not a test",
        "REGISTRY's `make example` names tests/nowhere.py::test_it, which is not a test",
    ])


def test_the_pages_are_read_as_a_shell_and_markdown_read_them():
    page = "\n".join([
        "Run `make demo` or `` python -m gradnorm.audit `x` ``, not `python` alone; `torchrun",
        "--standalone` spans a line break.",
        "```bash",
        "# a comment line",
        "$ OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone \\",
        "    gradnorm/train.py --steps 1   # a trailing comment",
        "cat notes.txt",
        "```",
        "```python",
        "python = 3",
        "```",
        "```",
        "runs/grpo/",
        "    make me a tree",
        "```",
    ])
    commands = page_commands(page, "docs/x.md")
    assert [(c.text, c.line, c.inline) for c in commands] == [
        ("OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone gradnorm/train.py --steps 1", 5, False),
        ("make me a tree", 14, False),  # an untagged block's line that begins with a command is one
        ("make demo", 1, True), ("python -m gradnorm.audit `x`", 1, True), ("torchrun --standalone", 1, True)]
    # docs/reliability.md's rows quote commands inside the faults they describe: its blocks count, its spans do not
    assert [c.text for c in page_commands(page, "docs/reliability.md")] == [c.text for c in commands[:2]]


# ------------------------------------------------------------------ the commands no other test ran
#
# Each test reads one job of this table: the commands it runs, each as typed, and what they printed. The
# module starts the jobs of its selected tests at its first such test, two jobs at a time (a job's
# independent commands start together), so a short launch's idle wall time overlaps another's work.


def one(page: str, *needles: str, inline: bool | None = None) -> str:
    (text,) = shown(COMMANDS, page, *needles, inline=inline)
    return text


def ok(done: subprocess.CompletedProcess) -> str:
    """stdout + stderr of a command that exited 0 (all of it in the message when it did not)."""
    assert done.returncode == 0, f"{done.args[-1]}\nexit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    return done.stdout + done.stderr


def make_flags() -> str:
    """make_options (an environment installed before pyproject.toml's last edit is taken as current), or a skip
    where there is no environment at all."""
    if not (ROOT / ".venv" / "bin" / "python").exists():
        skip_or_fail("make's targets need .venv (make install)")
    return make_options(ROOT)


def step_metrics(out: Path) -> dict:
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])


def demo_job(tmp: Path) -> list[subprocess.CompletedProcess]:
    smaller = one("README.md", "DEMO_FLAGS=")  # the smaller flags the README says the suite uses
    return run_typed(ROOT, fill(smaller, {"make ": "make " + make_flags(), "DIR": str(tmp / "grpo")}))


def proof_job(tmp: Path) -> list[subprocess.CompletedProcess]:
    """docs/training.md's three runs, then docs/testing.md's twin finder on them."""
    block = shown(COMMANDS, "docs/training.md", "gradnorm/train.py --steps 1", inline=False)
    runs = run_typed(ROOT, *(fill(command, {"runs/": f"{tmp}/runs/"}) for command in block))
    if any(done.returncode for done in runs):
        return runs
    return runs + run_typed(ROOT, fill(one("docs/testing.md", "tests.helpers.twins"), {"/tmp/suite": str(tmp)}))


def tiny_llama_job(tmp: Path) -> list[subprocess.CompletedProcess]:
    """docs/huggingface.md's two commands in order (the run trains the model the first writes), then
    docs/checkpoints.md's export of the run's step 2 ("Any checkpoint converts the same way")."""
    build, train = shown(COMMANDS, "docs/huggingface.md", "tiny-llama", inline=False)
    export = fill(one("docs/checkpoints.md", "gradnorm.export runs/"),
                  {"runs/qwen7b-hf": "runs/hf", "runs/qwen7b": "runs/tiny-llama-grpo", "[--step 100]": "--step 2"})
    done = []
    for command in (build, train, export):
        done += run_typed(ROOT, fill(command, {"runs/": f"{tmp}/runs/"}))
        if done[-1].returncode:
            break
    return done


def drop_in_job(tmp: Path) -> list[subprocess.CompletedProcess]:
    """README's drop-in with --denominator group on 2 ranks and on 1 (`--nproc_per_node=1`), then both with local."""
    two = one("README.md", "examples/drop_in_ddp.py --denominator group")
    single = fill(two, {"--nproc_per_node=2": "--nproc_per_node=1"})
    return run_typed(ROOT, two, single, *(fill(c, {"group": "local"}) for c in (two, single)))


def audits_job(tmp: Path) -> list[subprocess.CompletedProcess]:
    sft, dpo = (one("README.md", f"examples/drop_in_{name}.py") for name in ("sft", "dpo"))
    pair_mean = one("README.md", "pair_mean_per_microbatch --objective dpo --microbatch-tokens 160")
    return run_typed(ROOT, sft, dpo, pair_mean)


def example_job(tmp: Path) -> list[subprocess.CompletedProcess]:
    return run_typed(ROOT, "make " + make_flags() + "example")


def step_path_job(tmp: Path) -> list[subprocess.CompletedProcess]:
    return run_typed(ROOT, one("docs/design.md", "benchmarks/step_path.py"))


# the longest chains first: a job that starts late should be a short one
JOBS = {"tiny_llama": tiny_llama_job, "proof": proof_job, "drop_in": drop_in_job, "demo": demo_job,
        "audits": audits_job, "step_path": step_path_job, "example": example_job}


def reads(job: str):
    """Marks a test as the reader of ``JOBS[job]`` (a plain attribute: the fixture starts what is selected)."""
    def mark(test):
        test.job = job
        return test
    return mark


@pytest.fixture(scope="module")
def ran(request, tmp_path_factory):
    """``ran(job)``: (its directory, its commands' results), each job run once; those of the module's
    selected tests start together at first use, two jobs at a time."""
    # getattr: under --nbmake the session holds notebook items too, which have no module
    mine = [item for item in request.session.items if getattr(item, "module", None) is request.module]
    wanted = [job for job in JOBS if any(getattr(item.function, "job", None) == job for item in mine)]
    pool = ThreadPoolExecutor(2, thread_name_prefix="documented")
    started = {}

    def start(job: str):
        directory = tmp_path_factory.mktemp(job)
        return directory, pool.submit(JOBS[job], directory)

    for job in wanted:
        started[job] = start(job)

    def result(job: str) -> tuple[Path, list[subprocess.CompletedProcess]]:
        if job not in started:
            started[job] = start(job)
        directory, future = started[job]
        return directory, future.result()

    yield result
    pool.shutdown(wait=True)


@pytest.mark.launch
@pytest.mark.slow
@reads("demo")
def test_make_demo_runs_the_readmes_torchrun_command_and_prints_the_readmes_rewards(ran):
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in shown(COMMANDS, "README.md", "make demo", inline=False)
    tmp, (done,) = ran("demo")
    printed = ok(done)
    # make echoes the recipe: the README's own command, then DEMO_FLAGS
    recipe = one("README.md", ".venv/bin/torchrun", "--device cpu --overwrite")
    assert f"{recipe} --steps 1 --output-dir {tmp / 'grpo'}\n" in done.stdout, done.stdout
    # what the README's demo table says the first steps print (seed 0, the default flags)
    table = dict(re.findall(r"^\| (random initialization|after the 40-step warm-up|GRPO step 1) \| ([\d.]+) \|$",
                            readme, re.M))
    assert f"warm-up: 40 supervised steps, sampled reward {table['random initialization']} -> " \
           f"{table['after the 40-step warm-up']}" in printed, printed
    assert f"step 1/1 reward {table['GRPO step 1']} " in printed, printed
    assert step_metrics(tmp / "grpo")["step"] == 1


@pytest.mark.launch
@pytest.mark.slow
@reads("proof")
def test_the_proof_in_training_md_runs_as_typed_and_prints_its_numbers(ran):
    doc = (ROOT / "docs" / "training.md").read_text()
    block = shown(COMMANDS, "docs/training.md", "gradnorm/train.py --steps 1", inline=False)
    assert len(block) == 3 and block[0].startswith(one("README.md", ".venv/bin/python gradnorm/train.py") + " ")
    tmp, done = ran("proof")
    for result in done:
        ok(result)
    w1, w2, local = (step_metrics(tmp / "runs" / name) for name in ("w1", "w2", "local"))
    # "Measured: the same rollout (583 and 1724 response tokens on the two ranks), a gradient norm of
    # 0.51528 for `token` in one process and on 2 ranks x 2 microbatches, and 0.941 for `local`."
    said = re.search(r"the same rollout \((\d+) and (\d+) response tokens on the two ranks\), a gradient norm of\s+"
                     r"([\d.]+) for `token` in one process and on 2 ranks x 2 microbatches, and ([\d.]+) for "
                     r"`local`", doc)
    assert said, "docs/training.md's Measured sentence moved: update this test's reading of it"
    tokens, token_norm, local_norm = [int(said[1]), int(said[2])], said[3], said[4]
    assert w2["tokens_per_rank"] == local["tokens_per_rank"] == tokens
    assert w1["rollout_digest"] == w2["rollout_digest"] == local["rollout_digest"]
    digits = len(token_norm.split(".")[1])
    assert f"{w1['grad_norm']:.{digits}f}" == f"{w2['grad_norm']:.{digits}f}" == token_norm
    assert w2["grad_norm"] == pytest.approx(w1["grad_norm"], rel=1e-5)  # "to fp32 rounding"
    assert f"{local['grad_norm']:.{len(local_norm.split('.')[1])}f}" == local_norm
    assert abs(local["grad_norm"] - w1["grad_norm"]) > 0.1 * w1["grad_norm"]  # the control: local differs
    # docs/testing.md's twin finder, on these runs: three uninterrupted runs, no two with the same flags
    assert len(done) == 4 and done[3].stdout.splitlines()[0] == \
        f"{tmp}: 3 run directories, 3 uninterrupted; 0 sets of twins", done[3].stdout


@pytest.mark.launch
@pytest.mark.slow
@reads("tiny_llama")
def test_the_tiny_llama_trains_and_exports_as_typed(ran):
    pytest.importorskip("transformers")
    tmp, done = ran("tiny_llama")
    build, train, export = (ok(result) for result in done)
    runs = tmp / "runs"
    assert f"trained policy saved to {runs}/tiny-llama-grpo/final (AutoModelForCausalLM.from_pretrained)" in train
    assert [line["step"] for line in map(json.loads, (runs / "tiny-llama-grpo" / "metrics.jsonl").open())] == [1, 2]
    assert f"saved {runs}/hf (AutoModelForCausalLM.from_pretrained)" in export
    assert json.loads((runs / "hf" / "config.json").read_text())["model_type"] == "llama"


@pytest.mark.launch
@pytest.mark.slow
@reads("drop_in")
def test_the_drop_in_with_a_denominator_prints_what_the_readme_says(ran):
    # "prints the step's gradient norm, the same as `--nproc_per_node=1` prints (one rank, its 2 microbatches
    # twice as large); with `--denominator local` the two runs print different norms". (It once compared
    # `--nproc_per_node=1 ... --accum-steps 4`: the same 4 microbatches, so `local` printed the same norm too.)
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "the same as `--nproc_per_node=1` prints (one rank, its 2 microbatches twice as large); with " \
           "`--denominator local` the two runs print different norms" in readme
    _, done = ran("drop_in")
    norms = []
    for result, mode, ranks in zip(done, ["group", "group", "local", "local"], [2, 1, 2, 1]):
        ok(result)
        line = re.fullmatch(rf"{mode}: gradient norm (\d+\.\d+) on {ranks} ranks x 2 microbatches\n", result.stdout)
        assert line, result.stdout
        norms.append(line[1])
    assert norms[0] == norms[1]
    assert norms[2] != norms[3]  # the control: local's norm depends on how the batch is split


@pytest.mark.launch
@pytest.mark.slow
@reads("audits")
def test_the_audits_the_readme_quotes_in_prose_say_what_it_says(ran):
    # "... say `INVARIANT`" (exit 0); the pair mean per microbatch "says `SKEWED`" (exit 1)
    _, done = ran("audits")
    for result, verdict, code in zip(done, ["INVARIANT", "INVARIANT", "SKEWED"], [0, 0, 1]):
        assert result.returncode == code and result.stderr == "", (result.args[-1], result.stderr)
        assert result.stdout.splitlines()[-1].startswith(f"verdict: {verdict}"), result.stdout


@pytest.mark.launch
@reads("example")
def test_make_example_prints_the_table_training_md_shows(ran):
    doc = (ROOT / "docs" / "training.md").read_text()
    (table,) = re.findall(r"```\n( +mode \|.*?)```", doc, re.S)
    _, (done,) = ran("example")
    assert f".venv/bin/{one('docs/training.md', 'gradnorm.teach.worked_example')}\n" in ok(done)  # make's echo
    printed = [line.rstrip() for line in done.stdout.splitlines()]
    for line in table.splitlines():
        assert line.rstrip() in printed, line


@pytest.mark.launch
@pytest.mark.slow
@reads("step_path")
def test_step_path_prints_the_loops_own_lines(ran):
    # docs/design.md: it "prints the lines of train.py that make those calls (the count all-reduce, each
    # microbatch's weights, times W, and its backward among them)"
    _, (done,) = ran("step_path")
    loop = ok(done).split("the calls gradnorm/train.py made during step 2")[1]
    for call in ("global_counts", "w = token_weights(", "(W * w *", "loss.backward()"):
        assert call in loop, call
