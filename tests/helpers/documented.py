"""Every command README.md and docs/*.md show a user, and the test that runs it as typed (or why none can here).

``documented(root)`` reads the pages and returns each command with its page and line:

- in a fenced block tagged ``bash``, ``sh``, ``shell`` or ``console``, or untagged: every line whose
  first word (after ``VAR=value`` assignments and a ``$ `` prompt) is a command a user types
  (``COMMAND_WORDS``, or a path into ``.venv/bin/``), a trailing ``\\`` joining the next line and
  a ``# comment`` dropped;
- in prose, every code span of two words or more that begins the same way (``make demo``,
  ``python -m gradnorm.audit examples/drop_in_sft.py:sft_loss --objective sft``), its line breaks
  read as spaces. Not in docs/reliability.md, whose rows quote commands inside the fault they
  describe ("before: ``sha256sum -c *.sha256`` skipped the dot file").

``REGISTRY`` maps each command (its whitespace collapsed) to an ``Entry``: the tests that run it
as a user types it (``tests/...py::test_name``; for the commands that no test ran before, those
in tests/project/test_documented_commands.py), or the reason it cannot run here, or both (a test
that runs it where it can, the reason for the part it cannot). ``problems`` is the check: a
documented command without an entry, an entry whose command no page shows any more, an entry with
neither tests nor reason, a test that does not exist.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# The first word of a line a user types into a shell, as the pages write them.
COMMAND_WORDS = frozenset({"make", "python", "python3", "torchrun", "pip", "jupyter", "sbatch", "srun", "env",
                           "cd", "sha256sum", "conda", "bash"})
SHELL_TAGS = frozenset({"", "bash", "sh", "shell", "console"})
FENCE = re.compile(r"^\s*```(\S*)\s*$")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=\S*$")
# A code span opens with a run of n backticks and closes at the next run of exactly n (CommonMark), so
# `` a span with `ticks` inside `` is one span; it may run over a line break.
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
TRAILING_COMMENT = re.compile(r"\s+#\s.*$")  # `make demo   # the main job`: bash ignores it


@dataclass(frozen=True)
class Command:
    """A command as a page shows it: ``text`` (whitespace collapsed), ``page`` (from the repository root), ``line``."""

    text: str
    page: str
    line: int
    inline: bool  # a code span in prose, not a line of a fenced block

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def is_command(text: str) -> bool:
    words = text.split()
    while words and ASSIGNMENT.match(words[0]):
        words = words[1:]
    return bool(words) and (words[0] in COMMAND_WORDS or words[0].startswith(".venv/bin/"))


def collapse(text: str) -> str:
    return " ".join(text.split())


def block_commands(lines: list[str], start: int, page: str) -> list[Command]:
    """The commands of one fenced block whose first line is line ``start`` (1-based) of ``page``."""
    found, pending, at = [], "", start
    for n, raw in enumerate(lines, start):
        line = raw.strip()
        if line.startswith("$ "):
            line = line[2:]
        if not pending:
            at = n
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        whole = TRAILING_COMMENT.sub("", pending + line)
        pending = ""
        if whole and not whole.startswith("#") and is_command(whole):
            found.append(Command(collapse(whole), page, at, inline=False))
    return found


def page_commands(text: str, page: str) -> list[Command]:
    """Every command of one page: its shell blocks' lines, then its prose's code spans (``inline``)."""
    found, prose, lines = [], [], text.splitlines()
    n = 0
    while n < len(lines):
        opening = FENCE.match(lines[n])
        if opening is None:
            prose.append((n + 1, lines[n]))
            n += 1
            continue
        end = n + 1
        while end < len(lines) and not FENCE.match(lines[end]):
            end += 1
        if opening.group(1) in SHELL_TAGS:
            found += block_commands(lines[n + 1:end], n + 2, page)
        prose.append((n + 1, ""))  # a block breaks a code span
        n = end + 1
    if page != "docs/reliability.md":
        joined = "\n".join(line for _, line in prose)
        starts = [number for number, _ in prose]
        for span in CODE_SPAN.finditer(joined):
            if len(span.group(2).split()) >= 2 and is_command(span.group(2)):
                found.append(Command(collapse(span.group(2)), page, starts[joined.count("\n", 0, span.start())],
                                     inline=True))
    return found


def documented(root: Path, texts: dict[str, str] | None = None) -> list[Command]:
    """The commands of README.md and docs/*.md under ``root`` (or of ``texts``, page name -> Markdown)."""
    if texts is None:
        texts = {str(page.relative_to(root)): page.read_text() for page in pages(root)}
    return [command for page, text in texts.items() for command in page_commands(text, page)]


def shown(commands: list[Command], page: str, *needles: str, inline: bool | None = None) -> list[str]:
    """The texts of the commands ``page`` shows that hold every one of ``needles``, in page order."""
    return [c.text for c in commands if c.page == page and all(n in c.text for n in needles)
            and (inline is None or c.inline == inline)]


def fill(text: str, values: dict[str, str]) -> str:
    """``text`` with each key of ``values`` (a placeholder or a path the page made up) replaced, longest key first."""
    keys = sorted(values, key=len, reverse=True)
    return re.sub("|".join(map(re.escape, keys)), lambda m: values[m.group(0)], text)


def typed(command: str, root: Path) -> subprocess.Popen:
    """``command`` run by bash from ``root`` as a user types it into a shell whose virtual environment is active
    (this Python's bin/ first on PATH: the bare ``python`` and ``torchrun`` the pages type)."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return subprocess.Popen(["bash", "-c", command], cwd=root, env={**os.environ, "PATH": path},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 900) -> subprocess.CompletedProcess:
    """The ended ``proc``: exit status, stdout, stderr (the generous timeout is for a busy 2-core machine)."""
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_typed(root: Path, *commands: str, timeout: float = 900) -> list[subprocess.CompletedProcess]:
    """``commands`` started together, each as ``typed`` starts it; their results in the same order."""
    procs = [typed(command, root) for command in commands]
    return [finish(proc, timeout) for proc in procs]


def make_options(root: Path) -> str:
    """What make needs beside a page's arguments: nothing where the environment is current.

    Every make target first brings .venv up to date with pyproject.toml (pip install); CI's `make test`
    has just done it. Where pyproject.toml is newer than .venv/.installed (an edit since the last
    `make install`), a test must not reinstall, so make is told the stamp is current (``-o``), which is
    what `make install` would have made it; the recipe that runs is the same.
    """
    stale = subprocess.run(["make", "-q", ".venv/.installed"], cwd=root, capture_output=True).returncode != 0
    return "-o .venv/.installed " if stale else ""


@dataclass(frozen=True)
class Entry:
    """The tests that run a command as typed, or the reason it cannot run here (or both: what runs, and what cannot)."""

    tests: tuple[str, ...] = ()
    reason: str = ""


def test_exists(root: Path, node: str) -> bool:
    """Whether ``tests/x.py::test_name`` (or ``::Class::test_name``) is a test function of that file."""
    path, *names = node.split("::")
    file = root / path
    if not file.is_file() or not names:
        return False
    scope = ast.parse(file.read_text()).body
    for name in names:
        match = [node for node in scope if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and node.name == name]
        if not match:
            return False
        scope = match[0].body if isinstance(match[0], ast.ClassDef) else []
    return names[-1].startswith("test")


def problems(commands: list[Command], registry: dict[str, Entry], root: Path) -> list[str]:
    """What is wrong between the pages' commands and the registry: one line each; [] when they agree."""
    shown = {command.text for command in commands}
    found = [f"{command.where()}: `{command.text}` has no entry in tests/helpers/documented.py's REGISTRY "
             f"(name the test that runs it as typed, or why it cannot run here)"
             for command in commands if command.text not in registry]
    for text, entry in registry.items():
        if text not in shown:
            found.append(f"REGISTRY names `{text}`, which no page shows any more")
        if not entry.tests and not entry.reason:
            found.append(f"REGISTRY's `{text}` names neither a test nor a reason")
        found += [f"REGISTRY's `{text}` names {node}, which is not a test" for node in entry.tests
                  if not test_exists(root, node)]
    return sorted(set(found), key=found.index)


# The tests of tests/project/test_documented_commands.py, which run the commands no other test ran.
HERE = "tests/project/test_documented_commands.py::"
DEMO = HERE + "test_make_demo_runs_the_readmes_torchrun_command_and_prints_the_readmes_rewards"
PROOF = HERE + "test_the_proof_in_training_md_runs_as_typed_and_prints_its_numbers"
TINY_LLAMA = HERE + "test_the_tiny_llama_trains_and_exports_as_typed"
DROP_IN = HERE + "test_the_drop_in_with_a_denominator_prints_what_the_readme_says"
EXAMPLE = HERE + "test_make_example_prints_the_table_training_md_shows"
PROSE_AUDITS = HERE + "test_the_audits_the_readme_quotes_in_prose_say_what_it_says"
STEP_PATH = HERE + "test_step_path_prints_the_loops_own_lines"
EXAMPLES_EXIT = "tests/distributed/test_examples_exit.py::test_an_example_run_as_the_readme_shows_exits_0_with_its_line"
AUDIT_DOCS = "tests/unit/audit/test_audit_objectives.py::test_the_docs_show_what_each_sft_dpo_and_composite_command_prints"
TRAINER_AUDIT = "tests/e2e/test_trainer_audit.py::test_loss_kwargs_dropped_is_skewed_by_w_times_a"
SCRIPT_AUDIT = "tests/e2e/test_trainer_audit.py::test_unchanged_script_dropping_loss_kwargs_is_skewed"
RESHARD = "tests/e2e/test_checkpoints.py::test_a_resumed_run_matches_the_uninterrupted_one_on_any_world_size_and_parallel"
ELASTIC = "tests/reliability/test_auto_resume.py::test_an_elastic_restart_after_a_sigkill_continues_the_run_by_itself"
TWO_NODES = "tests/e2e/test_topology.py::test_two_nodes_of_one_worker_train_as_one_node_of_two"
SLURM = "tests/reliability/test_slurm_grace.py::test_node_sh_gives_torchrun_the_grace_period"
BROWSER = "tests/notebooks/test_browser.py::test_notebook_slider_redraws_its_plot"

SUITE = ("the test suite itself, or a part of it: .ci/run runs `make test`, `make test-trainers` and `make test-vllm` "
         "on a fresh clone; a test cannot run the suite that holds it")
INSTALL = "an install step: `make test` (and .ci/run) installs the environment the suite runs in before any test"
BENCH = ("a measurement that rewrites committed results under benchmarks/ (or docs/benchmarks.md, README's demo "
         "block): minutes to an hour of CPU, run by hand with `make bench`, never by the suite")
NAME = "the command's name in prose; each full form a page shows has its own entry"
FRAGMENT = "a launcher's flags named in prose, not a whole command; the commands they belong to have entries"

REGISTRY: dict[str, Entry] = {
    # README.md: the quick start and the demo
    "make demo": Entry((DEMO,), "the suite runs it with DEMO_FLAGS=\"--steps 1 --output-dir DIR\" (README says so)"),
    'make demo DEMO_FLAGS="--steps 1 --output-dir DIR"': Entry((DEMO,)),
    "OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=2 gradnorm/train.py --device cpu --overwrite":
        Entry((DEMO,), "make demo runs exactly this line, which the test reads in make's echo"),
    ".venv/bin/python gradnorm/train.py": Entry((PROOF,), "with --steps 1: docs/training.md's first command"),
    "python gradnorm/train.py": Entry((PROOF,), "prose for the one-process run; docs/training.md's first command"),
    "make demo TORCH=\"torch==2.13.0 --index-url <CUDA wheel index>\"": Entry((), INSTALL + ", with a CUDA build of "
                                                                              "torch from the network"),
    "conda env create -f environment.yml": Entry(("tests/project/test_packaging.py::"
                                                  "test_environment_yml_lists_the_same_dependencies_as_pyproject",),
                                                 "installs from conda's channels over the network; the test checks "
                                                 "that the file lists pyproject's dependencies"),
    "make install": Entry((), INSTALL),
    "make test": Entry((), SUITE),
    "make test-fast": Entry((), SUITE),
    "make test-trainers": Entry((), SUITE),
    "make test-vllm": Entry((), SUITE + "; it builds .venv-vllm from the network"),
    "make test COV=": Entry((), SUITE),
    '.venv/bin/python -m pytest --nbmake -m "not browser"': Entry((), SUITE),
    ".venv/bin/python -m pytest --basetemp=/tmp/suite": Entry((), SUITE),
    ".venv/bin/python -m tests.helpers.twins /tmp/suite": Entry((PROOF,), "on the runs of docs/training.md's block"),
    # README.md: the drop-in examples
    "python -m gradnorm.audit examples/drop_in_ddp.py:grpo_loss": Entry((
        "tests/unit/cli/test_user_code_exits.py::test_control_the_isolated_command_passes_on_a_real_report",)),
    "OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 examples/drop_in_ddp.py --denominator group":
        Entry((DROP_IN,)),
    "torchrun --standalone --nproc_per_node=2": Entry(
        (EXAMPLES_EXIT,), "the launcher the README gives the SFT and DPO examples, which the test runs without flags"),
    "python -m gradnorm.audit examples/drop_in_sft.py:sft_loss --objective sft": Entry((PROSE_AUDITS,)),
    "python -m gradnorm.audit examples/drop_in_dpo.py:dpo_loss --objective dpo": Entry((PROSE_AUDITS,)),
    # the audit
    "python -m gradnorm.audit": Entry((), NAME),
    "python -m gradnorm.audit --trainer file.py:build": Entry((), NAME + " (file.py:build stands for the reader's "
                                                                         "own build)"),
    "python -m gradnorm.audit --trainer/--script": Entry((), NAME),
    "python -m gradnorm.audit --trainer ... --keep DIR": Entry((), NAME + " (a flag added to any --trainer audit)"),
    "torchrun --standalone": Entry((), FRAGMENT),
    ".venv/bin/python -m gradnorm.audit gradnorm.audit.conventions:microbatch_token_mean --world-size 8 "
    "--accum-steps 4": Entry(("tests/unit/audit/test_audit.py::test_the_real_entry_point",)),
    "python -m gradnorm.audit gradnorm.audit.dpo_conventions:pair_mean_per_microbatch --objective dpo "
    "--microbatch-tokens 160": Entry((PROSE_AUDITS,)),
    ".venv/bin/python -m gradnorm.audit gradnorm.audit.sft_conventions:model_loss_under_accelerate --objective sft "
    "--step --world-size 8 --accum-steps 4": Entry((AUDIT_DOCS,), "its argv, read off the page, in pytest's process"),
    ".venv/bin/python -m gradnorm.audit gradnorm.audit.dpo_conventions:pair_mean_per_microbatch --objective dpo "
    "--world-size 4 --accum-steps 2 --microbatch-tokens 160 --sharding interleave length":
        Entry((AUDIT_DOCS,), "its argv, read off the page, in pytest's process"),
    ".venv/bin/python -m gradnorm.audit gradnorm.audit.composite_conventions:nll_term_per_microbatch --world-size 2 "
    "--accum-steps 32 --sharding interleave": Entry((AUDIT_DOCS,), "its argv, read off the page, in pytest's process"),
    "python -m gradnorm.audit --trainer examples/trainers/hf_trainer.py:build_dropping": Entry(
        (TRAINER_AUDIT,), "the test audits the same build through audit_trainer at W=2 A=2 (one torchrun launch); "
                          "the command's three launches of transformers' Trainer run in make test-trainers' time"),
    "python -m gradnorm.audit --script -- torchrun --standalone --nproc_per_node 2 examples/trainers/hf_script.py "
    "--model {model} --data {data} --output-dir {output_dir} --grad-accum 2 --drop-loss-kwargs": Entry((SCRIPT_AUDIT,)),
    "python -m gradnorm.audit.pastes docs/audit.md": Entry((AUDIT_DOCS,), "rewrites the page in place; the test "
                                                                        "checks that each paste is what its command "
                                                                        "prints now, which is all it would change"),
    "python -m gradnorm.audit.pastes FILE.md": Entry(("tests/unit/audit/test_audit_findings.py::"
                                                      "test_pastes_regenerates_the_audit_s_output_in_a_page",)),
    # docs/training.md, docs/huggingface.md, docs/checkpoints.md
    ".venv/bin/python gradnorm/train.py --steps 1 --output-dir runs/w1": Entry((PROOF,)),
    "OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=2 gradnorm/train.py --steps 1 "
    "--grad-accum-steps 2 --shard length --output-dir runs/w2": Entry((PROOF,)),
    "OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=2 gradnorm/train.py --steps 1 "
    "--grad-accum-steps 2 --shard length --loss-denominator local --output-dir runs/local": Entry((PROOF,)),
    "make example": Entry((EXAMPLE,)),
    "python -m gradnorm.teach.worked_example": Entry((EXAMPLE,), "the command make example runs, read in its echo"),
    "torchrun --max-restarts": Entry((ELASTIC,), FRAGMENT),
    "torchrun --max-restarts=2 ...": Entry((ELASTIC,), FRAGMENT),
    ".venv/bin/python examples/tiny_models.py llama runs/tiny-llama": Entry((TINY_LLAMA,)),
    "OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=2 gradnorm/train.py --model runs/tiny-llama "
    "--prompts-per-step 4 --group-size 4 --max-new-tokens 24 --steps 2 --output-dir runs/tiny-llama-grpo":
        Entry((TINY_LLAMA,)),
    "torchrun --standalone --nproc_per_node=N gradnorm/train.py --model Qwen/Qwen2.5-0.5B-Instruct --prompts "
    "examples/arithmetic.jsonl --prompts-per-step 64 --group-size 8 --max-new-tokens 256 --grad-accum-steps 4 "
    "--lr 1e-6 --steps 200 --output-dir runs/qwen": Entry((), "downloads Qwen2.5-0.5B from the Hugging Face Hub and "
                                                              "needs GPUs; its shape (torchrun, --model, 2 steps) runs "
                                                              "on the tiny Llama in " + TINY_LLAMA),
    "torchrun --nnodes=M --nproc_per_node=N --rdzv-id=grpo-qwen --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 "
    "gradnorm/train.py --model Qwen/Qwen2.5-7B-Instruct --parallel fsdp --gradient-checkpointing --prompts "
    "my_prompts.jsonl --prompts-per-step 256 --group-size 8 --max-new-tokens 512 --grad-accum-steps 8 --lr 1e-6 "
    "--steps 200 --output-dir runs/qwen7b": Entry((TWO_NODES,), "several nodes of GPUs and a model from the Hugging "
                                                                "Face Hub; the test runs the c10d rendezvous of two "
                                                                "agents on this machine"),
    "python benchmarks/gpu_check.py": Entry(("tests/project/test_gpu_check.py::"
                                             "test_without_cuda_the_check_explains_and_exits_1",),
                                            "its table needs a GPU; without one the test checks its one line"),
    "pip install -e '.[hf]'": Entry((), INSTALL),
    "pip install -e '.[report]'": Entry((), INSTALL),
    "pip install -e '.[vllm]'": Entry((), INSTALL + " (make test-vllm builds .venv-vllm this way)"),
    "pip install -e '.[hf,vllm]'": Entry((), INSTALL + " (make test-vllm builds .venv-vllm this way)"),
    "pip uninstall -y torchvision torchaudio torchcodec": Entry((), INSTALL + " (make test-vllm's last step)"),
    "cd ckpt_step10 && sha256sum -c .metadata.sha256 *.sha256": Entry((
        "tests/reliability/test_checksums_bind.py::test_the_docs_command_checks_every_sidecar_dot_files_included",),
        "in a real checkpoint, ckpt_step2 for ckpt_step10"),
    "torchrun --standalone --nproc_per_node=4 gradnorm/train.py <the same flags> --parallel ddp --resume": Entry(
        (RESHARD,), "the test resumes 2 FSDP2 ranks on 2 DDP ranks and on 1 process (4 ranks of 2 cores would "
                    "add a minute)"),
    "python -m gradnorm.export": Entry((), NAME),
    "python -m gradnorm.export runs/qwen7b --out runs/qwen7b-hf [--step 100]": Entry((TINY_LLAMA,)),
    # docs/scale.md
    "torchrun --nnodes=N --node-rank=$NODE_RANK --nproc_per_node=8 --rdzv-backend=c10d "
    "--rdzv-endpoint=$FIRST_NODE:29500 --rdzv-id=$JOB_ID gradnorm/train.py --auto-resume --output-dir "
    "/shared/runs/qwen7b <the run's flags>": Entry((TWO_NODES,), "several nodes of 8 processes; the test runs the "
                                                                "c10d rendezvous of two agents on this machine"),
    "sbatch --nodes=4 examples/slurm/train.sbatch --model Qwen/Qwen2.5-7B-Instruct --prompts my.jsonl --output-dir "
    "/shared/runs/qwen7b --parallel fsdp --save-every 20": Entry((SLURM,), "needs Slurm; the test runs the script's "
                                                                          "node.sh with a stub for torchrun"),
    # docs/notebooks.md
    "jupyter lab notebooks/": Entry((BROWSER,), "a server a person works in; the browser tests start JupyterLab "
                                                "the same way (tests/helpers/jupyterlab.py) and drive it in Chromium"),
    ".venv/bin/jupyter lab notebooks/": Entry((BROWSER,), "as jupyter lab notebooks/"),
    "make figures": Entry(("tests/notebooks/test_figures.py::"
                           "test_every_embedded_or_shown_figure_is_made_by_the_command",
                           "tests/notebooks/test_figures.py::test_output_is_deterministic"),
                          "rewrites the committed figures/ in place; the tests call figures/make_figures.py's "
                          "functions and render into tmp_path"),
    # measurements
    "make bench": Entry((), BENCH),
    "make study": Entry((), BENCH),
    "make bench-vllm": Entry((), BENCH + "; in .venv-vllm"),
    "python benchmarks/demo.py": Entry((), BENCH),
    "python benchmarks/bench.py": Entry((), BENCH),
    "python benchmarks/phases.py": Entry((), BENCH),
    "python benchmarks/rollouts.py --drift": Entry((), BENCH),
    "python benchmarks/checkpoint_memory.py --out benchmarks": Entry((), BENCH),
    "python benchmarks/cli_parsers.py --rounds 10 --out benchmarks": Entry((), BENCH),
    "python benchmarks/canvas_latency.py --presses 20 --out benchmarks": Entry((), BENCH),
    "python benchmarks/step_path.py": Entry((STEP_PATH,)),
    # docs/vllm.md
    "OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 gradnorm/train.py --model <that model> --prompts "
    "examples/arithmetic.jsonl --reward <module:function> --prompts-per-step 2 --group-size 4 --max-new-tokens 12 "
    "--seed 1 --rollout-engine vllm --steps 5 --output-dir runs/vllm": Entry(
        ("tests/e2e/test_vllm_rollout.py::test_two_ranks_learn_from_vllm_rollouts",),
        "needs vLLM's CPU build, which make test-vllm installs in .venv-vllm; the test runs these flags there"),
}
