"""Bad input never loses a run and never ends in a traceback: one table of cases, each a command.

Every row of CASES is a command line of ``gradnorm/train.py`` that must fail in the preflight,
before any model is built: exit code 2, stdout empty, stderr a single ``error:`` line naming the
flag, file or variable (the reward rows may add the user's own frames, never the word Traceback
and never a frame of gradnorm), and the case's directory exactly as it was before: nothing
half-written. Every row runs through ``main()`` in this process (milliseconds), and one row or
two per class (CLI) also as a real ``python gradnorm/train.py`` (a Python start each, two at a
time). tests/reliability/test_bad_input_runtime.py has what fails while running, and the torchrun launches.
"""

import json
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from tests.helpers.fakes import fake_checkpoint, fake_model
from tests.helpers.trainer import tiny

from gradnorm.train import main
from gradnorm.trainer.config import TrainConfig
from gradnorm.trainer.guards.launch import TORCHRUN_VARS

ROOT = Path(__file__).resolve().parents[2]
QUICK = tiny(warmup_steps="0", seed=None)  # TINY, no warm-up, the default seed: every case fails before a step


@dataclass
class Case:
    flags: list[str]
    """Flags after ``--output-dir {case}/run``; ``{case}`` is the case's own directory."""
    says: str
    """What the error line must contain."""
    setup: object = None
    """setup(case_dir): files the case needs."""
    env: dict = field(default_factory=dict)
    """Extra environment variables."""
    output_dir: str | None = "{case}/run"


def reward_module(source: str):
    """setup: a model and pkgs/{module}.py, a module named after the case (imports are cached)."""
    def setup(case: Path) -> None:
        fake_model(case / "model")
        (case / "pkgs").mkdir()
        (case / "pkgs" / f"{module_of(case)}.py").write_text(source)
    return setup


def module_of(case: Path) -> str:
    return "rewards_" + case.name.replace("-", "_")


def run_with(flags=(), config=None, checkpoint="ckpt_step2", extra=None):
    """setup: a run directory holding config.json (TrainConfig from ``flags``) and a checkpoint directory."""
    def setup(case: Path) -> None:
        run = case / "run"
        run.mkdir()
        if config is not None:
            (run / "config.json").write_text(config)
        else:
            from gradnorm.trainer.config import build_parser

            cfg = TrainConfig(**vars(build_parser().parse_args([*QUICK, *flags, "--output-dir", str(run)])))
            (run / "config.json").write_text(json.dumps({**cfg.to_dict(), "world_size": 1}))
        if checkpoint:
            fake_checkpoint(run, checkpoint)
        if extra:
            extra(run)
    return setup


def hf(case_flags: list[str], model="{case}/model") -> list[str]:
    return ["--model", model, "--prompts", "examples/arithmetic.jsonl", *case_flags]


CASES = {
    # ---- numeric flags: finite and in range, checked on the dataclass
    "lr-inf": Case(["--lr", "inf"], "--lr must be a finite number in (0, 1], got inf"),
    "lr-huge": Case(["--lr", "1e30"], "--lr must be a finite number in (0, 1], got 1e+30"),
    "weight-decay-inf": Case(["--weight-decay", "inf"], "--weight-decay must be a finite number in [0, 1]"),
    "beta-inf": Case(["--beta", "inf"], "--beta must be a finite number in [0, 100]"),
    "beta-huge": Case(["--beta", "1e30"], "--beta must be a finite number in [0, 100], got 1e+30"),
    "temperature-tiny": Case(["--temperature", "1e-40"], "--temperature must be a finite number in [0.001, 100]"),
    "timeout-inf": Case(["--timeout-s", "inf"], "--timeout-s must be a finite number in [10, 604800]"),
    "timeout-tiny": Case(["--timeout-s", "1e-9"], "--timeout-s must be a finite number in [10, 604800]"),
    "denominator-tiny": Case(["--loss-denominator", "1e-300"], "--loss-denominator 1e-300: a constant C must be"),
    "seed-24-digits": Case(["--seed", "1" * 24], "--seed must be an integer in [0, 9223372036854775807]"),
    "steps-not-int": Case(["--steps", "1e3"], "argument --steps: invalid int value: '1e3'"),
    # ---- flags that make no sense together
    "output-dir-empty": Case(["--output-dir", ""], "--output-dir is empty", output_dir=None),
    "prompts-without-model": Case(["--prompts", "examples/arithmetic.jsonl"], "--prompts needs a Hugging Face --model"),
    "reward-without-model": Case(["--reward", "exact_match_math"], "--reward needs a Hugging Face --model"),
    "resume-and-overwrite": Case(["--resume", "--overwrite"], "--resume continues the run in --output-dir and --overwrite"),
    # ---- the output directory
    "output-dir-is-a-file": Case([], "--output-dir {case}/run is a file",
                                 setup=lambda case: (case / "run").write_text("x")),
    "output-dir-under-a-file": Case(["--output-dir", "{case}/file/run"], "cannot be created: {case}/file is a file",
                                    setup=lambda case: (case / "file").write_text("x"), output_dir=None),
    "output-dir-under-proc": Case(["--output-dir", "/proc/gradnorm-run"], "is under /proc, a virtual filesystem",
                                  output_dir=None),
    "output-dir-not-writable": Case([], "is not writable: Permission denied",
                                    setup=lambda case: (case / "ro").mkdir(mode=0o555), output_dir="{case}/ro/run"),
    "output-dir-symlink-loop": Case([], "--output-dir {case}/run is a symlink loop",
                                    setup=lambda case: (case / "run").symlink_to(case / "run")),
    "output-dir-under-a-symlink-loop": Case([], "cannot be created: {case}/loop is a symlink loop",
                                            setup=lambda case: (case / "loop").symlink_to(case / "loop"),
                                            output_dir="{case}/loop/run"),
    "output-dir-dangling-symlink": Case([], "--output-dir {case}/run is a dangling symlink (to {case}/nowhere)",
                                        setup=lambda case: (case / "run").symlink_to(case / "nowhere")),
    "output-dir-name-too-long": Case([], "is 300 bytes long, more than this filesystem allows", output_dir="{case}/" + "r" * 300),
    "output-dir-holds-a-run": Case([], "holds a run (ckpt_step2, config.json): --resume to continue it, --overwrite",
                                   setup=run_with()),
    "output-dir-holds-a-torn-checkpoint": Case([], "holds a run (.ckpt_step2.tmp): --resume to continue it",
                                               setup=lambda case: fake_checkpoint(case / "run", ".ckpt_step2.tmp")),
    "output-dir-locked": Case(["--resume"], "is in use by another run (pid {pid} on host {host}",
                              setup=run_with(extra=lambda run: (run / ".lock").write_text(json.dumps(
                                  {"pid": os.getpid(), "host": socket.gethostname()})))),
    "overwrite-stranded": Case([], "holds the run that an --overwrite replaced, and the replacement stopped before",
                               setup=run_with(checkpoint=None, extra=lambda run: (  # as the trainer makes it: marked
                                   (run / "previous_run").mkdir(), (run / "previous_run" / ".gradnorm-previous").touch()))),
    # ---- --resume: the flags that define the run must match its config.json
    "resume-other-beta": Case(["--resume", "--beta", "0.1"], "differ from {case}/run/config.json: --beta 0.0 -> 0.1;",
                              setup=run_with()),
    "resume-other-max-new-tokens": Case(["--resume", "--max-new-tokens", "30", "--seed", "4"],
                                        "--max-new-tokens 20 -> 30, --seed 0 -> 4;", setup=run_with()),
    "resume-other-accumulation-under-local": Case(
        ["--resume", "--loss-denominator", "local", "--grad-accum-steps", "2"], "--grad-accum-steps 1 -> 2",
        setup=run_with(["--loss-denominator", "local"])),
    "resume-nothing-to-do": Case(["--resume", "--steps", "2"], "ckpt_step2 is at step 2 and --steps is 2",
                                 setup=run_with()),
    "resume-latest-checkpoint-by-step": Case(["--resume", "--steps", "10"], "ckpt_step10 is at step 10 and --steps is 10",
                                             setup=run_with(extra=lambda run: fake_checkpoint(run, "ckpt_step10"))),
    "resume-torn-config": Case(["--resume"], "config.json is unreadable", setup=run_with(config='{"seed": 0,')),
    "resume-no-checkpoint": Case(["--resume"], "--resume: no complete checkpoint ckpt_step*/ in {case}/run"),
    "resume-only-a-torn-checkpoint": Case(["--resume"], "--resume: no complete checkpoint ckpt_step*/ in {case}/run",
                                          setup=run_with(checkpoint=".ckpt_step2.tmp")),
    "resume-old-single-file-checkpoint": Case(
        ["--resume"], "no complete checkpoint ckpt_step*/ in {case}/run (its ckpt_step*.pt files are the single-file",
        setup=run_with(checkpoint=None, extra=lambda run: (run / "ckpt_step2.pt").write_bytes(b"an old checkpoint"))),
    # ---- the environment: a stale shell
    "env-rank-without-master": Case([], "sets RANK=1 but not WORLD_SIZE, MASTER_ADDR, MASTER_PORT", env={"RANK": "1"}),
    "env-leftover-world-size": Case([], "sets WORLD_SIZE=4 but not RANK", env={"WORLD_SIZE": "4"}),
    "env-stale-torchrun": Case(["--timeout-s", "10"], "sets RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 "
                               "but no launcher started this process (no TORCHELASTIC_RUN_ID",
                               env={"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}),
    # every variable of a torchrun worker, copied from a job that has ended: before, 50 s of C++ retries
    "env-copied-from-an-ended-torchrun-job": Case(
        [], "the environment names torchrun job 'ended', but no store answers at MASTER_ADDR:MASTER_PORT 127.0.0.1:9 "
        "(Connection refused): copied from a launch that has ended?",
        env={"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9", "LOCAL_RANK": "1",
             "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "ended", "TORCHELASTIC_USE_AGENT_STORE": "True"}),
    "env-local-world-size-0": Case([], "LOCAL_WORLD_SIZE=0: expected the number of processes of this job on this host",
                                   env={"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                                        "TORCHELASTIC_RUN_ID": "test", "LOCAL_WORLD_SIZE": "0"}),
    # ---- memory: the worst-case rollout cannot fit
    "memory-training": Case(["--prompts-per-step", "1000000", "--group-size", "4096"],
                            "TiB per rank on cpu (training"),
    "memory-rollout": Case(["--prompts-per-step", "1000000", "--group-size", "4096", "--grad-accum-steps", "4096"],
                           "TiB per rank on cpu (rollout"),
    # ---- a Hugging Face model, its prompts and the user's reward
    "model-missing-relative": Case(hf([], model="examples/no-such-model"), "--model examples/no-such-model: no such directory"),
    "model-missing-dot": Case(hf([], model="./no-such-model"), "--model ./no-such-model: no such directory"),
    "model-not-a-name": Case(hf([], model="my model!"), "is neither an existing directory nor a Hub id"),
    # a bare name with no such directory is a Hub id: uncached and out of reach, it fails at once (before: 50 s of
    # the loader's retries, then "cannot load its tokenizer (We couldn't connect to 'https://huggingface.co' ...)")
    "model-missing-bare-name-hub-unreachable": Case(
        hf([], model="tiny-llama"), "--model tiny-llama: no directory tiny-llama here (a local model: give its path, "
        "e.g. ./tiny-llama), and as a Hub id it is not in the local Hugging Face cache and http://127.0.0.1:9 cannot be "
        "reached (Connection refused)", env={"HF_ENDPOINT": "http://127.0.0.1:9"}),
    "model-missing-bare-name-offline": Case(
        hf([], model="tiny-llama"), "--model tiny-llama: no directory tiny-llama here (a local model: give its path, "
        "e.g. ./tiny-llama), and as a Hub id it is not in the local Hugging Face cache, with HF_HUB_OFFLINE set",
        env={"HF_HUB_OFFLINE": "1"}),
    "model-without-config": Case(hf([]), "config.json is missing", setup=lambda case: (case / "model").mkdir()),
    "model-torn-safetensors": Case(hf([]), "model.safetensors is truncated or corrupt",
                                   setup=lambda case: fake_model(case / "model", truncate=True)),
    "prompts-missing": Case(hf(["--prompts", "{case}/none.jsonl"]), "--prompts: prompts file {case}/none.jsonl does not exist",
                            setup=lambda case: fake_model(case / "model")),
    "prompts-not-json": Case(hf(["--prompts", "{case}/p.jsonl"]), "p.jsonl:1: not valid JSON",
                             setup=lambda case: (fake_model(case / "model"), (case / "p.jsonl").write_text("{oops\n"))),
    "reward-no-module": Case(hf(["--reward", "no_such_module:f"]), "--reward 'no_such_module:f': cannot import it",
                             setup=lambda case: fake_model(case / "model")),
    "reward-syntax-error": Case(hf(["--reward", "{module}:score"]),
                                "reward function {module}:score failed to import: SyntaxError",
                                setup=reward_module("def score(response, answer)\n    return 1.0\n")),
    "reward-raises-on-import": Case(hf(["--reward", "{module}:score"]),
                                    "failed to import: RuntimeError('no GPU for my reward model')",
                                    setup=reward_module("raise RuntimeError('no GPU for my reward model')\n")),
    "reward-wrong-signature": Case(hf(["--reward", "{module}:score"]),
                                   "must take (response, answer); its signature is (response)",
                                   setup=reward_module("def score(response):\n    return 1.0\n")),
    "reward-not-callable": Case(hf(["--reward", "{module}:score"]), "is not callable (it is a float)",
                                setup=reward_module("score = 1.0\n")),
}
USER_FRAMES = {"reward-syntax-error": "{module}.py\", line 1", "reward-raises-on-import": "{module}.py\", line 1"}
NEEDS_NON_ROOT = {"output-dir-not-writable"}  # root writes anywhere


CLI = ["lr-inf", "steps-not-int", "output-dir-holds-a-run", "output-dir-locked", "resume-other-beta",
       "env-rank-without-master", "env-stale-torchrun", "memory-rollout", "model-missing-relative", "reward-raises-on-import"]


def fill(text: str, case: Path) -> str:
    return text.format(case=case, pid=os.getpid(), host=socket.gethostname(), module=module_of(case))


def snapshot(directory: Path) -> dict:
    """Every path under ``directory``, with size and mtime for files (a directory's mtime moves when
    the write test's file comes and goes)."""
    return {str(p.relative_to(directory)): None if p.is_dir() else (p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in sorted(directory.rglob("*"))}  # lstat: a symlink loop or a dangling link is a case's input


def prepare(name: str, base: Path) -> tuple[Path, list[str], dict]:
    """The case's directory (set up), its argv and its extra environment."""
    case, directory = CASES[name], base / name
    directory.mkdir()
    if case.setup:
        case.setup(directory)
    argv = [*QUICK, *(fill(flag, directory) for flag in case.flags)]
    if case.output_dir:
        argv += ["--output-dir", fill(case.output_dir, directory)]
    return directory, argv, case.env


def check(name: str, code: int, stdout: str, stderr: str, directory: Path) -> None:
    lines = stderr.splitlines()
    assert code == 2, stderr
    assert stdout == "", stdout
    assert lines and lines[0].startswith("error: "), stderr
    assert fill(CASES[name].says, directory) in lines[0], stderr
    assert sum(line.startswith("error: ") for line in lines) == 1, stderr
    assert "Traceback" not in stderr and "gradnorm/" not in "\n".join(lines[1:]), stderr
    if name in USER_FRAMES:  # the user's own frames, where the problem is
        assert fill(USER_FRAMES[name], directory) in stderr, stderr
    else:
        assert len(lines) == 1, stderr


def skip_as_root(name: str) -> None:
    if name in NEEDS_NON_ROOT and os.geteuid() == 0:
        pytest.skip("root can write into a read-only directory")


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_error_line_exit_2_and_writes_nothing(name, tmp_path, monkeypatch, capsys):
    skip_as_root(name)
    directory, argv, env = prepare(name, tmp_path)
    for variable in (*TORCHRUN_VARS, "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(directory / "pkgs"))
    before = snapshot(directory)
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's own errors exit from inside parse_args
        code = stop.code
    out, err = capsys.readouterr()
    check(name, code, out, err, directory)
    assert snapshot(directory) == before  # nothing created, written, moved or deleted


def launch(name: str, base: Path):
    directory, argv, extra = prepare(name, base)
    before = snapshot(directory)
    env = {k: v for k, v in os.environ.items() if k not in (*TORCHRUN_VARS, "TORCHELASTIC_RUN_ID", "SLURM_PROCID")}
    path = os.pathsep.join([str(ROOT), str(directory / "pkgs"), os.environ.get("PYTHONPATH", "")])
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=path, **extra)
    proc = subprocess.run([sys.executable, "gradnorm/train.py", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    return proc, before, snapshot(directory), directory


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory):
    base = tmp_path_factory.mktemp("bad_input_cli")
    with ThreadPoolExecutor(max_workers=2) as pool:  # a Python start each; two at a time
        return dict(zip(CLI, pool.map(lambda name: launch(name, base), CLI)))


@pytest.mark.launch
@pytest.mark.parametrize("name", CLI)
def test_the_command_line_says_the_same_in_one_line(name, cli_results):
    proc, before, after, directory = cli_results[name]
    check(name, proc.returncode, proc.stdout, proc.stderr, directory)
    assert after == before


def test_every_numeric_flag_has_a_range_and_the_table_checks_the_ones_the_audit_broke():
    from typing import get_type_hints

    from gradnorm.trainer.config import BOUNDS

    numeric = {name for name, kind in get_type_hints(TrainConfig).items() if kind in (int, float)}
    assert set(BOUNDS) == numeric
    for name, allowed in BOUNDS.items():  # the defaults are inside, and the range excludes inf
        assert getattr(TrainConfig(), name) in allowed, name
        assert float("inf") not in allowed and float("nan") not in allowed, name
