"""What goes wrong while a run runs: one error line with the step, nothing lost, and the run directory's rules.

Faults are injected in-process (``main()`` of gradnorm/train.py with one function monkeypatched:
the rollout of a given step raises what a failing sampler or allocator raises), so a few seconds
cover each class. Two torchrun launches show that rank 0's line comes first under torchrun, and
one Hugging Face run shows a user's reward raising in the middle of a rollout.
"""

import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.helpers.runfiles import every_file
from tests.helpers.trainer import one_error_line, run_main, tiny, torchrun_cmd

from gradnorm import train as train_module
from gradnorm.models.tinygpt import GPTConfig, TinyGPT
from gradnorm.tasks import RepeatTask
from gradnorm.tasks.rewards import RewardError, call_reward
from gradnorm.trainer.checkpoint import checkpointer, store
from gradnorm.trainer.checkpoint.checkpointer import RUN_FIELDS
from gradnorm.trainer.config import CHANGEABLE_ON_RESUME, TrainConfig, field_docs, parse_config
from gradnorm.trainer.guards import launch, memory
from gradnorm.trainer.ownership.lock import RunDir
from gradnorm.trainer.logs.metrics import open_metrics, write_record

ROOT = Path(__file__).resolve().parents[2]
# TINY without the supervised warm-up: the faults here are injected in the GRPO steps (or before them),
# and nothing depends on what the model learned, so each run starts its steps at once
FLAGS = tiny(warmup_steps="0")


def rollout_raises(monkeypatch, at_step: int, error: BaseException, watch: Path | None = None) -> list:
    """The rollout of ``at_step`` raises ``error`` (as a failing sampler or allocator would).

    Returns a list that gets (step, the files in ``watch`` and in its previous_run/) at every rollout.
    """
    honest, seen = train_module.generate_rollout, []

    def rollout(*args, **kwargs):
        if watch is not None:
            previous = watch / "previous_run"
            seen.append((kwargs["step"], sorted(os.listdir(watch)),
                         sorted(os.listdir(previous)) if previous.is_dir() else []))
        if kwargs["step"] == at_step:
            raise error
        return honest(*args, **kwargs)

    monkeypatch.setattr(train_module, "generate_rollout", rollout)
    return seen


# ------------------------------------------------------------------ errors while training


@pytest.mark.parametrize("error, says", [
    (ValueError("the policy's logits became non-finite (lower --lr)"),
     "error: step 3: the policy's logits became non-finite (lower --lr)"),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB"),
     "error: step 3: out of memory on cpu (CUDA out of memory. Tried to allocate 80.00 GiB); raise --grad-accum-steps"),
    (MemoryError(), "error: step 3: out of memory on cpu (MemoryError); raise --grad-accum-steps"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to "
                  "allocate 8589934592 bytes. Error code 12 (Cannot allocate memory)"),
     "error: step 3: out of memory on cpu ([enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't"),
])
def test_an_error_in_a_step_is_one_line_with_the_step_and_the_checkpoints_stay(error, says, tmp_path, monkeypatch, capsys):
    rollout_raises(monkeypatch, 3, error)
    out = tmp_path / "run"
    assert run_main(out, "--steps", "4", "--save-every", "1", base=FLAGS) == 1
    one_error_line(capsys.readouterr().err, says)
    assert sorted(p.name for p in out.iterdir() if "ckpt" in p.name) == ["ckpt_step1", "ckpt_step2"]  # no .tmp
    assert store.read_run_state(out / "ckpt_step2", required=RUN_FIELDS)["step"] == 2
    assert store.read_tensors(out / "ckpt_step2", "model")  # complete: its tensors load
    assert not (out / ".lock").exists()


def test_a_fresh_run_that_fails_before_its_first_step_leaves_nothing(tmp_path, monkeypatch, capsys):
    rollout_raises(monkeypatch, 1, ValueError("boom"))
    out = tmp_path / "new" / "run"
    assert run_main(out, "--steps", "2", base=FLAGS) == 1
    one_error_line(capsys.readouterr().err, "error: step 1: boom")
    assert not (tmp_path / "new").exists()


def test_a_non_finite_step_prints_null_instead_of_crashing(tmp_path, monkeypatch, capsys):
    honest, calls = train_module.grpo_token_losses, []

    def poisoned(*args, **kwargs):  # step 2's loss is NaN: the step is skipped and logged as null
        calls.append(None)
        terms = honest(*args, **kwargs)
        if len(calls) == 2:
            terms.loss = terms.loss * float("nan")
        return terms

    monkeypatch.setattr(train_module, "grpo_token_losses", poisoned)
    assert run_main(tmp_path / "run", "--steps", "3", "--log-every", "1", base=FLAGS) == 0
    captured = capsys.readouterr()
    assert "step 2/3 reward" in captured.out and "loss null grad_norm null" in captured.out, captured.out
    assert "Traceback" not in captured.err


def test_write_record_formats_none_as_null(capsys):
    class Bar:
        disable = True

        def update(self, n):
            pass

        def set_postfix(self, **kwargs):
            self.postfix = kwargs

    class Sink:
        text = ""

        def write(self, s):
            self.text += s

        def flush(self):
            pass

    bar, sink = Bar(), Sink()
    record = {"step": 5, "reward_mean": None, "loss": None, "grad_norm": None, "tokens_per_second": None}
    write_record(sink, bar, record, TrainConfig(steps=5))
    assert capsys.readouterr().out == "step 5/5 reward null loss null grad_norm null tokens/s null\n"
    assert json.loads(sink.text) == record and bar.postfix == {"reward": "null", "tok_s": "null"}


# ------------------------------------------------------------------ metrics.jsonl on --resume


def test_open_metrics_drops_torn_and_foreign_lines_with_a_warning(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\n{"loss": 1}\n\n{"step": 2}\n{"step": 3}\n{"step": 4, "lo')
    open_metrics(path, 2).close()
    assert path.read_text() == '{"step": 1, "loss": 0.5}\n{"step": 2}\n'
    err = capsys.readouterr().err
    assert f"warning: {path}:2: dropped not a metrics record" in err
    assert f"warning: {path}:6: dropped a torn last line (the run stopped mid-write)" in err
    (tmp_path / "missing.jsonl").unlink(missing_ok=True)
    open_metrics(tmp_path / "missing.jsonl", 7).close()
    assert "missing.jsonl is missing; it starts again at step 8" in capsys.readouterr().err
    assert (tmp_path / "missing.jsonl").read_text() == ""


def test_metrics_lines_are_on_disk_before_the_checkpoint_that_covers_them(tmp_path, monkeypatch):
    """Before, metrics.jsonl was flushed, never fsynced: a power cut could keep a checkpoint and tear its line."""
    events, honest_fsync, honest_save = [], os.fsync, checkpointer.save_checkpoint

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        honest_fsync(fd)

    def save_checkpoint(out, model, opt, ref, state, ctx, **kwargs):
        events.append(("save", state.step))
        honest_save(out, model, opt, ref, state, ctx, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(checkpointer, "save_checkpoint", save_checkpoint)
    out = tmp_path / "run"
    assert run_main(out, "--steps", "3", "--save-every", "2", base=FLAGS) == 0
    saves = [i for i, event in enumerate(events) if event[0] == "save"]
    assert [events[i] for i in saves] == [("save", 2), ("save", 3)]
    for i in saves:  # the last fsync before each save is metrics.jsonl's, with the save's line in it
        assert [e for e in events[:i] if e[0] == "fsync"][-1] == ("fsync", "metrics.jsonl"), events


def test_a_torn_line_of_the_checkpointed_step_is_restored_from_the_checkpoint(tmp_path, capsys):
    """Before, resume dropped it: the step's record was gone for good."""
    out = tmp_path / "run"
    assert run_main(out, "--steps", "2", base=FLAGS) == 0
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])  # step 2's line torn mid-write
    assert run_main(out, "--steps", "3", "--resume", base=FLAGS) == 0
    err = capsys.readouterr().err
    assert "the record of step 2 was torn or missing; restored from its checkpoint" in err, err
    resumed = path.read_text().splitlines()
    assert resumed[:2] == lines and json.loads(resumed[2])["step"] == 3


def test_resume_recreates_missing_metrics_and_records_what_changed(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_main(out, "--steps", "2", base=FLAGS) == 0
    (out / "metrics.jsonl").unlink()
    assert run_main(out, "--steps", "3", "--resume", "--log-every", "1", base=FLAGS) == 0
    assert "metrics.jsonl is missing; it starts again at step 3" in capsys.readouterr().err
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [3]
    config = json.loads((out / "config.json").read_text())
    assert config["steps"] == 3 and config["log_every"] == 1  # the latest values at the top
    first, second = config["history"]
    assert first["step"] == 0 and "changed" not in first
    assert second["step"] == 2 and second["changed"] == {"steps": [2, 3], "log_every": [10, 1]}


def test_resume_compares_files_by_what_they_resolve_to_and_numbers_by_value(tmp_path, monkeypatch):
    from gradnorm.trainer.ownership.history import compare_resumed

    monkeypatch.chdir(ROOT)
    (tmp_path / "model").mkdir()
    (tmp_path / "other.jsonl").write_text("")
    (tmp_path / "link").symlink_to(tmp_path / "model")
    hf = ["--model", str(tmp_path / "model"), "--prompts", "examples/arithmetic.jsonl", "--loss-denominator", "1000"]
    old = parse_config(hf).to_dict()
    same = ["--model", str(tmp_path / "link"), "--prompts", str(ROOT / "examples" / "arithmetic.jsonl"),
            "--loss-denominator", "1e3", "--resume"]
    compare_resumed(parse_config(same), old)  # the same run, spelt another way: no error
    compare_resumed(parse_config([*same, "--lr", "1e-6"]), {**old, "lr": 0.000001})
    for flags, says in [(["--prompts", str(tmp_path / "other.jsonl")], "--prompts examples/arithmetic.jsonl -> "),
                        (["--loss-denominator", "1001"], "--loss-denominator 1000 -> 1001"),
                        (["--seed", str(2**62 + 1)], f"--seed {2**62} -> {2**62 + 1}")]:  # equal as floats
        with pytest.raises(ValueError, match=says):
            compare_resumed(parse_config([*same, *flags]), {**old, "seed": 2**62})


def test_resume_refuses_a_prompts_file_regenerated_at_the_same_path(tmp_path):
    from gradnorm.trainer.ownership.history import compare_resumed, read_config, write_config

    prompts, model = tmp_path / "p.jsonl", tmp_path / "model"
    prompts.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    model.mkdir()
    flags = ["--model", str(model), "--prompts", str(prompts)]
    write_config(tmp_path, parse_config(flags), 1, 0)
    old = read_config(tmp_path)
    compare_resumed(parse_config([*flags, "--resume"]), old)  # the same bytes: no error
    prompts.write_text('{"prompt": "2+2?", "answer": "4"}\n')  # regenerated in place
    with pytest.raises(ValueError, match=r"--prompts .*p\.jsonl is not the file this run trained on"):
        compare_resumed(parse_config([*flags, "--resume"]), old)
    # the control: a config.json of an earlier version, without the digest, is resumed as before
    compare_resumed(parse_config([*flags, "--resume"]), {k: v for k, v in old.items() if k != "prompts_sha256"})


def test_a_local_run_resumes_only_on_its_own_number_of_ranks():
    # Under local W is part of the objective (weights 1 / (W A N[r, m])); a token run may change it.
    from gradnorm.trainer.ownership.history import compare_resumed

    local = ["--loss-denominator", "local", "--resume"]
    old = {**parse_config(local).to_dict(), "world_size": 1}
    compare_resumed(parse_config(local), old, world_size=1)  # the same W: no error
    with pytest.raises(ValueError, match="local on 1 rank, and this start has 2; .* same number of ranks"):
        compare_resumed(parse_config(local, world_size=2), old, world_size=2)
    # the control: the same change of W under the default token mean is allowed
    token = ["--resume"]
    compare_resumed(parse_config(token, world_size=2), {**parse_config(token).to_dict(), "world_size": 1},
                    world_size=2)


def test_main_refuses_to_resume_a_local_run_on_another_number_of_ranks(tmp_path, capsys):
    # Through main(): the W it checks is this start's. The run is written on 1 process and its
    # config.json then says 2 ranks, the same state a 2-rank run's directory is in.
    out = tmp_path / "run"
    assert run_main(out, "--loss-denominator", "local", "--steps", "1", base=FLAGS) == 0
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "world_size": 2}))
    capsys.readouterr()
    assert run_main(out, "--loss-denominator", "local", "--steps", "2", "--resume", base=FLAGS) == 2
    one_error_line(capsys.readouterr().err, "local on 2 ranks, and this start has 1")
    (out / "config.json").write_text(json.dumps(config))  # the control: its own W resumes
    assert run_main(out, "--loss-denominator", "local", "--steps", "2", "--resume", base=FLAGS) == 0


# ------------------------------------------------------------------ --overwrite and the lock


def test_overwrite_keeps_the_old_run_until_the_new_one_has_a_checkpoint(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    assert run_main(out, "--steps", "2", base=FLAGS) == 0
    old = store.read_tensors(out / "ckpt_step2", "model")
    seen = rollout_raises(monkeypatch, 99, ValueError("never"), watch=out)
    assert run_main(out, "--steps", "2", "--seed", "5", "--save-every", "1", "--overwrite", base=FLAGS) == 0
    err = capsys.readouterr().err
    assert "the previous run in" in err
    assert f"so that old run is deleted now: {out / 'previous_run'}/ is gone" in err  # said when it goes
    # The old run, whole, was set aside until the new run had finished (and so had checkpoints).
    # its marker too, and the one that says the trainer made previous_run/
    old_run = [".gradnorm-previous", ".gradnorm-run", "ckpt_step2", "config.json", "metrics.jsonl", "warmup.json"]
    assert [step for step, _, _ in seen] == [1, 2]
    assert seen[0][1] == [".gradnorm-run", ".lock", "config.json", "metrics.jsonl", "previous_run", "warmup.json"]
    assert seen[1][1] == [".gradnorm-run", ".lock", "ckpt_step1", "config.json", "metrics.jsonl", "previous_run",
                          "warmup.json"]
    assert seen[0][2] == seen[1][2] == old_run
    assert sorted(os.listdir(out)) == [".gradnorm-run", "ckpt_step1", "ckpt_step2", "config.json", "metrics.jsonl",
                                       "warmup.json"]
    new = store.read_tensors(out / "ckpt_step2", "model")  # the new run's, not the old one kept
    assert new.keys() == old.keys() and any(not torch.equal(new[k], old[k]) for k in old)
    assert json.loads((out / "config.json").read_text())["seed"] == 5


def test_overwrite_that_fails_before_a_checkpoint_puts_the_old_run_back(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    assert run_main(out, "--steps", "2", base=FLAGS) == 0
    before = every_file(out)
    assert "ckpt_step2/.metadata" in before  # the checkpoint directory's files are compared too
    rollout_raises(monkeypatch, 1, ValueError("boom"))
    assert run_main(out, "--steps", "2", "--seed", "5", "--overwrite", base=FLAGS) == 1
    err = capsys.readouterr().err
    one_error_line(err, "error: step 1: boom")
    assert "the previous run is back in" in err
    assert every_file(out) == before


@pytest.mark.launch
def test_a_stale_lock_is_taken_over_with_a_warning_and_a_live_one_is_not(tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    run_dir = RunDir(out)
    run_dir.open(resume=False, overwrite=False)
    assert f"was left by pid {dead.pid}, which is no longer running" in capsys.readouterr().err
    assert json.loads((out / ".lock").read_text())["pid"] == os.getpid()
    with pytest.raises(ValueError, match=f"is in use by another run \\(pid {os.getpid()} on host"):
        RunDir(out).open(resume=True, overwrite=False)
    run_dir.close(succeeded=True)
    assert not (out / ".lock").exists() and out.is_dir()


# ------------------------------------------------------------------ rules that need no run


@pytest.mark.parametrize("value, says", [
    (lambda r, a: 1 / 0, "raised ZeroDivisionError('division by zero') on sequence 4 (answer '42')"),
    (lambda r, a: None, "returned NoneType None on sequence 4; it must return one number"),
    (lambda r, a: [1.0], "returned list [1.0] on sequence 4"),
    (lambda r, a: "1.0", "returned str '1.0' on sequence 4"),
    (lambda r, a: float("nan"), "returned nan on sequence 4; rewards must be finite"),
    (lambda r, a: 1e39, "returned 1e+39 on sequence 4, beyond float32's range (|reward| <= 3.403e+38)"),
    (lambda r, a: -1e39, "returned -1e+39 on sequence 4, beyond float32's range"),
    (lambda r: 1.0, "raised TypeError("),
])
def test_a_reward_that_misbehaves_is_named_with_its_sequence(value, says):
    with pytest.raises(RewardError) as caught:
        call_reward(value, "response", "42", 4)
    assert says in str(caught.value).splitlines()[0]
    assert call_reward(lambda r, a: np.float32(0.5), "x", "y", 0) == 0.5  # numbers of any kind
    assert call_reward(lambda r, a: torch.tensor(1.0), "x", "y", 0) == 1.0
    assert call_reward(lambda r, a: 3e38, "x", "y", 0) == 3e38  # the control: float32's largest still pass


def test_a_reward_that_closes_stdout_is_named(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stdout", stream)
    assert call_reward(lambda r, a: print("scored") or 1.0, "x", "y", 0) == 1.0  # the control: printing is fine
    with pytest.raises(RewardError, match="reward function .* closed sys.stdout on sequence 3; a reward must leave"):
        call_reward(lambda r, a: stream.close() or 1.0, "x", "y", 3)


ENDS_THE_TRAINER = {
    "when called": "import os\nfrom gradnorm.tasks.rewards import call_reward\n"
                   "call_reward(lambda r, a: os._exit(0), 'response', '7', 2)\n",
    "at import": "import pathlib, sys\nsys.path.insert(0, sys.argv[1])\n"
                 "pathlib.Path(sys.argv[1], 'exiting_reward.py').write_text('import os\\nos._exit(0)\\n')\n"
                 "from gradnorm.tasks.rewards import get_reward\nget_reward('exiting_reward:score')\n",
}


@pytest.mark.launch
@pytest.mark.parametrize("when", ENDS_THE_TRAINER)
def test_a_reward_calling_os_exit_is_a_reward_error_not_the_end_of_the_trainer(when, tmp_path):
    """os._exit(0) in a reward ended the trainer at once with exit 0 and no output: a success to CI.
    The reward's call (and its import) runs under usercode.no_process_exit, so it is a RewardError."""
    done = subprocess.run([sys.executable, "-c", ENDS_THE_TRAINER[when], str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1, (done.returncode, done.stderr)
    summary = [line for line in done.stderr.splitlines() if "RewardError: " in line]
    assert summary and "os._exit(0)" in summary[0], done.stderr
    assert summary[0].endswith({"when called": "raised os._exit(0) on sequence 2 (answer '7')",
                                "at import": "exiting_reward:score failed to import: os._exit(0)"}[when])


@pytest.mark.parametrize("environ, expected", [
    ({}, (0, 1)),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "j"}, (1, 2)),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500", "SLURM_PROCID": "1"}, (1, 2)),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}, "but no launcher started this"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500", "SLURM_PROCID": "0"}, "no launcher"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}, "expected 0 <= RANK < WORLD_SIZE"),
    ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}, "must be integers"),
    ({"MASTER_ADDR": "h", "MASTER_PORT": "1"}, (0, 1)),  # no RANK, no WORLD_SIZE: nothing torchrun-like
])
def test_launch_environment(environ, expected):
    if isinstance(expected, tuple):
        assert launch.launch_environment(environ) == expected
    else:
        with pytest.raises(ValueError, match=expected.replace("(", "\\(")):
            launch.launch_environment(environ)


def test_every_flag_changeable_on_resume_says_so_in_its_docstring():
    docs = field_docs()
    says = {name for name, doc in docs.items() if "Changeable on --resume" in doc}
    assert says == set(CHANGEABLE_ON_RESUME) - {"resume", "overwrite"}


def test_the_rollout_estimate_is_the_size_of_the_real_kv_cache_and_prefill_logits(monkeypatch):
    cfg = parse_config([*FLAGS, "--prompts-per-step", "3", "--group-size", "4"])
    shape = memory.model_shape(cfg)
    task = RepeatTask(max_new_tokens=cfg.max_new_tokens)
    model = TinyGPT(GPTConfig(task.vocab_size, task.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd))
    S = cfg.prompts_per_step * cfg.group_size
    assert shape["params"] == sum(p.numel() for p in model.parameters())
    cache = model.new_kv_cache(S)
    prompts, _ = task.sample_prompts(S, torch.Generator().manual_seed(0))
    prefill = model(prompts, kv_cache=cache)  # (S, P, V): what generate's first call holds
    real = (cache.k.numel() + cache.v.numel() + prefill.numel()) * 4
    assert memory.estimate(cfg, shape, 1, "cpu")["rollout"] == real
    # The control: the same configuration with far less free memory is refused.
    parts = memory.estimate(cfg, shape, 1, "cpu")
    need = parts["static"] + max(v for k, v in parts.items() if k != "static")  # the warm-up's batch too
    monkeypatch.setattr(memory, "available", lambda device: need - 1)
    with pytest.raises(ValueError, match=f"needs at least {memory.size(need)} per rank on cpu"):
        memory.check_fits(cfg, 1, torch.device("cpu"))
    monkeypatch.setattr(memory, "available", lambda device: need)
    memory.check_fits(cfg, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="are free"):  # two ranks on one host share its memory
        memory.check_fits(cfg, 1, torch.device("cpu"), sharing=2)


# ------------------------------------------------------------------ real launches


@pytest.mark.parametrize("flags, part, says", [
    (["--eval-prompts", "1000000"], "eval", "(eval 3.4 GiB: --eval-prompts 1000000, --max-new-tokens 20)"),
    (["--warmup-batch", "1000000"], "warmup", "--warmup-batch 1000000, --max-new-tokens 20), but 1.0 GiB are free; "
                                              "the warm-up trains on whole sequences in one batch: lower --warmup-batch"),
    # the model alone: before, the line named the batch's flags and "a smaller --model" for the built-in model
    # (a layer of width d holds 12 d^2 weights: 12 x 65536^2 = 51.5B)
    (["--n-embd", "65536"], "static", "GiB: --n-layer 1 x --n-embd 65536, 51.5B parameters), but 1.0 GiB are free; "
                                      "the weights, gradients and AdamW state alone need that: lower --n-embd or "
                                      "--n-layer, or --parallel fsdp over more ranks"),
])
def test_the_estimate_covers_the_evaluation_and_the_warm_up(flags, part, says, monkeypatch):
    """Before, --eval-prompts 1000000 and --warmup-batch 1000000 passed: only a step's batch was counted.
    Each part's line names the flags behind it."""
    monkeypatch.setattr(memory, "available", lambda device: 2**30)
    memory.check_fits(parse_config(FLAGS), 1, torch.device("cpu"))  # the control: the small run fits 1 GiB
    cfg = parse_config([*FLAGS, *flags])
    assert max(memory.estimate(cfg, memory.model_shape(cfg), 1, "cpu").items(), key=lambda kv: kv[1])[0] == part
    with pytest.raises(ValueError, match="needs at least") as caught:
        memory.check_fits(cfg, 1, torch.device("cpu"))
    assert says in str(caught.value)


REWARD_MODULE = '''
def score(response, answer):
    given = response.strip()
    return float(int(given) == int(answer))  # a random model's response is no integer: ValueError
'''


@pytest.mark.slow
def test_a_user_reward_that_raises_mid_rollout_shows_its_own_frames_only(tmp_path):
    pytest.importorskip("transformers")
    from tiny_models import build_tiny_llama

    model = build_tiny_llama(tmp_path / "tiny-llama", seed=0)
    (tmp_path / "pkgs").mkdir()
    (tmp_path / "pkgs" / "raising_rewards.py").write_text(REWARD_MODULE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' loading bar
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path / "pkgs"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "gradnorm/train.py", "--model", str(model), "--reward", "raising_rewards:score",
                           "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8", "--eval-prompts", "2",
                           "--steps", "1", "--no-plot", "--output-dir", str(tmp_path / "run")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    # the message quotes the sampled response, whose own quotes decide repr's quote character
    assert lines[0].startswith("error: reward function raising_rewards:score raised ValueError("), proc.stderr
    assert "invalid literal for int() with base 10" in lines[0], proc.stderr
    assert "on sequence 0 (answer '" in lines[0]
    assert "Traceback" not in proc.stderr and "gradnorm" not in "\n".join(lines[1:]), proc.stderr
    assert lines[1:3] == [f'  File "{tmp_path / "pkgs" / "raising_rewards.py"}", line 4, in score',
                         "    return float(int(given) == int(answer))  # a random model's response is no integer: "
                         "ValueError"]
    assert not (tmp_path / "run").exists()  # failed before its first step: nothing left behind


def torchrun(out: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_cmd(out, *flags, base=FLAGS),
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["indivisible-batch", "corrupt-checkpoint"])
def test_under_torchrun_rank_0s_error_line_comes_first(kind, tmp_path):
    """torchrun adds its own report of the failed workers (and exits 1) after our line; it is always there."""
    out = tmp_path / "run"
    if kind == "indivisible-batch":  # found by every rank before the process group exists
        proc, says = torchrun(out, "--prompts-per-step", "3", "--group-size", "3"), "cannot be split over 2 ranks"
    else:  # found by every rank inside train(), after the process group exists, reading the checkpoint
        (out / "ckpt_step1").mkdir(parents=True)
        run = {"step": 1, "warmup": {}, "elapsed_s": 0.0, "skipped": 0, "in_a_row": 0}
        (out / "ckpt_step1" / "trainer_state.json").write_text(json.dumps(run))
        (out / "ckpt_step1" / ".metadata").write_text("not a checkpoint")
        proc, says = torchrun(out, "--steps", "2", "--resume"), "ckpt_step1 is truncated or corrupt (.metadata:"
    assert proc.returncode != 0
    first = proc.stderr.splitlines()[0]
    assert first.startswith("error: ") and says in first, proc.stderr
    assert sum(line.startswith("error: ") for line in proc.stderr.splitlines()) == 1, proc.stderr
    assert "rank 1:" not in proc.stderr  # rank 1 was stopped by torchrun while it waited


def test_nothing_to_do_names_the_export_a_killed_end_of_run_export_left_unfinished(tmp_path):
    """A run killed in its end-of-run export has every step done; --resume said only "raise --steps",
    never the command that writes the export from the last checkpoint."""
    from gradnorm.trainer.guards import outpaths
    from gradnorm.trainer.ownership.history import resume_point, write_config

    prompts, model, run = tmp_path / "p.jsonl", tmp_path / "model", tmp_path / "run"
    prompts.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    model.mkdir()
    flags = ["--model", str(model), "--prompts", str(prompts), "--steps", "2", "--output-dir", str(run)]
    run.mkdir()
    write_config(run, parse_config(flags), 1, 0)
    (run / "ckpt_step2").mkdir()
    outpaths.create(outpaths.temporary(run / "final"))  # what a kill mid-export leaves: run/.final.tmp, marked
    with pytest.raises(ValueError) as caught:
        resume_point(parse_config([*flags, "--resume"]))
    assert str(caught.value).endswith(
        f"raise --steps to continue the run; the run's export did not finish (a killed export left {run}/.final.tmp): "
        f"python -m gradnorm.export {run} --out {run}/final writes it from ckpt_step2")
    outpaths.temporary(run / "final").rename(run / "final")  # the control: the export finished
    with pytest.raises(ValueError) as caught:
        resume_point(parse_config([*flags, "--resume"]))
    assert str(caught.value).endswith("raise --steps to continue the run")


def test_the_hub_probe_gives_no_verdict_behind_a_proxy(monkeypatch):
    """A cluster that reaches the Hub through HTTPS_PROXY must not be told the Hub is out of reach."""
    from gradnorm.trainer.guards.preflight import _unreachable

    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert _unreachable("https://127.0.0.1:9") == "Connection refused"  # the control: no proxy, a closed port
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    assert _unreachable("https://127.0.0.1:9") is None
