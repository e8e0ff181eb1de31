"""Sharded checkpoints (torch.distributed.checkpoint) and the Hugging Face export.

Five real launches of a tiny random Llama (built offline, ``build_tiny_llama``) over gloo, with
``--beta 0.05`` so the reference policy is part of every checkpoint:

    fsdp2        torchrun, 2 ranks, --parallel fsdp, 4 steps, checkpoints after steps 2 and 4; final/
    fsdp2-to-1   fsdp2's step-2 checkpoint resumed by one plain process (no process group)
    fsdp2-to-ddp fsdp2's step-2 checkpoint resumed on 2 DDP ranks
    ddp2-killed  torchrun, 2 ranks, --parallel ddp, SIGKILLed while every rank is inside DCP's
                 writer for the step-4 checkpoint (a launcher script makes the writer hang there)
    ddp-to-fsdp2 the killed run resumed with --resume on 2 FSDP2 ranks

What must hold:
- every resumed run logs steps 3 and 4 as fsdp2 did (bit-identical rollouts; loss, grad norm, KL,
  rewards to fp32 rounding) and ends with the same weights; the DDP run's steps 1-3 match too;
- the killed save left the step-2 checkpoint complete and only a ``.ckpt_step4.tmp`` without
  ``.metadata``, which ``--resume`` skipped (it resumed from step 2) and the next save replaced;
- final/ loads with ``AutoModelForCausalLM.from_pretrained`` and gives the log-probs of the step-4
  checkpoint's weights on a fixed batch, which differ from the initial model's (the control);
  ``python -m gradnorm.export`` writes the same model from the checkpoint.

In-process, on the built-in tiny model: an I/O error while saving (in DCP's writer, or in rank 0's
publishing) is one ``error:`` line, removes the temporary directory and keeps the previous
checkpoint; with ``--beta > 0`` a resumed run restores the reference policy (the post-warm-up
policy, which only the checkpoint has) and AdamW's moments; the ``.metadata`` unpickler accepts a
real checkpoint and refuses anything else. And rank 0's memory while saving under FSDP2 (with
benchmarks/checkpoint_memory.py): about nothing beyond its shard, against the whole state gathered.
"""

import errno
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from tests.helpers.faults import Evil, fail_in_publish
from tests.helpers.runfiles import assert_same_steps, launch_all
from tests.helpers.runfiles import metrics
from tests.helpers.trainer import TINY, one_error_line
from torch.distributed.checkpoint import FileSystemWriter
from torch.testing import assert_close

from gradnorm.dist import state as dist_state
from gradnorm.models.tinygpt import GPTConfig, TinyGPT
from gradnorm.teach.launch import torchrun_command
from gradnorm.train import main
from gradnorm.trainer.checkpoint import store

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ in-process: I/O errors, the unpickler


def fail_in_dcp_writer(monkeypatch, step: int) -> None:
    """Every rank's DCP writer leaves half a shard and raises ENOSPC while writing ``ckpt_step{step}``."""
    honest = FileSystemWriter.write_data

    def full_disk(self, plan, planner):
        if f"ckpt_step{step}." in str(self.path):
            (Path(self.path) / "__0_0.distcp").write_bytes(b"half a shard")
            raise OSError(errno.ENOSPC, "No space left on device")
        return honest(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)


@pytest.mark.parametrize("fault, says", [(fail_in_dcp_writer, "No space left on device"),
                                         (fail_in_publish, "Permission denied")])
def test_an_io_error_while_saving_is_one_line_and_keeps_the_previous_checkpoint(fault, says, tmp_path, monkeypatch,
                                                                                capsys):
    out = tmp_path / "run"
    fault(monkeypatch, step=2)
    assert main([*TINY, "--output-dir", str(out), "--steps", "3", "--save-every", "1"]) == 1
    err = capsys.readouterr().err
    one_error_line(err, f"error: step 2: could not write checkpoint {out / 'ckpt_step2'} (")
    assert says in err and f"the previous checkpoint {out / 'ckpt_step1'} is intact; once the cause is fixed " \
        "(disk space, permissions), --resume continues from it" in err
    assert sorted(p.name for p in out.iterdir() if "ckpt" in p.name) == ["ckpt_step1"]  # no temporary directory
    assert [m["step"] for m in metrics(out)] == [1, 2]  # step 2 was logged; the run stopped at its checkpoint
    monkeypatch.undo()
    assert main([*TINY, "--output-dir", str(out), "--steps", "3", "--save-every", "1", "--resume"]) == 0
    assert [m["step"] for m in metrics(out)] == [1, 2, 3]


def test_a_resumed_run_restores_the_reference_policy_and_the_optimizer(tmp_path):
    """Built-in model, --beta > 0: the reference is the policy after warm-up, which a resumed run
    (no warm-up) can only get from the checkpoint; AdamW's moments shape step 4's update."""
    flags = ["--prompts-per-step", "4", "--group-size", "4", "--warmup-steps", "10", "--eval-prompts", "2",
             "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--no-plot", "--seed", "3", "--beta", "0.05",
             "--steps", "4", "--save-every", "2"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert main([*flags, "--output-dir", str(full)]) == 0
    shutil.copytree(full, resumed, ignore=shutil.ignore_patterns("ckpt_step4"))
    assert main([*flags, "--output-dir", str(resumed), "--resume"]) == 0
    assert_same_steps(resumed, full, steps=(3, 4))
    for got, want in zip(metrics(resumed)[2:], metrics(full)[2:]):
        assert want["kl"] > 0
        assert_close(got["kl"], want["kl"], rtol=1e-5, atol=0)
    want, got = (store.read_tensors(out / "ckpt_step4", "model") for out in (full, resumed))
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_resuming_with_a_reference_policy_the_checkpoint_lacks_is_one_line(tmp_path, capsys):
    """--beta defines the run: the preflight refuses the change against config.json (exit 2, nothing
    loaded); without a config.json (flags not compared) the checkpoint itself refuses (exit 1)."""
    out, resume = tmp_path / "run", [*TINY, "--output-dir", str(tmp_path / "run"), "--steps", "2", "--resume"]
    assert main([*TINY, "--output-dir", str(out), "--steps", "1"]) == 0
    assert main([*resume, "--beta", "0.05"]) == 2
    one_error_line(capsys.readouterr().err, "config.json: --beta 0.0 -> 0.05; resume with the run's values")
    (out / "config.json").unlink()
    assert main([*resume, "--beta", "0.05"]) == 1
    one_error_line(capsys.readouterr().err, "holds no reference policy (it was written with --beta 0); resume with --beta 0")


def test_taking_the_state_of_a_fresh_optimizer_does_not_change_its_next_update():
    """torch creates AdamW's state for a save or a load with a zero-gradient step; if that step
    counted, the next update's bias correction would change (a save after skipped first steps
    would alter the run). Without the reset in training_state the weights differ by ~3e-3."""

    def weights_after_one_step(take_state: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = TinyGPT(GPTConfig(8, 8, 1, 2, 8))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if take_state:
            dist_state.training_state(model, opt)
        model(torch.arange(6).view(1, 6)).sum().backward()
        opt.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert torch.equal(weights_after_one_step(True), weights_after_one_step(False))


@pytest.mark.parametrize("config, says", [
    (None, "cannot read the run's config.json"),
    ({"model": "tiny"}, "trained the built-in TinyGPT, which is not a Hugging Face model"),
    ({"model": "some/model"}, "no complete checkpoint ckpt_step*/"),
])
def test_the_export_command_says_in_one_line_what_it_cannot_convert(config, says, tmp_path, capsys):
    from gradnorm import export

    run = tmp_path / "run"  # the export goes beside it: inside a run only its final/ may be written
    run.mkdir()
    if config is not None:
        (run / "config.json").write_text(json.dumps(config))
    assert export.main([str(run), "--out", str(tmp_path / "hf")]) == 2  # bad input, as for the trainer
    one_error_line(capsys.readouterr().err, says)
    assert not (tmp_path / "hf").exists()


def real_checkpoint(directory: Path) -> Path:
    model = TinyGPT(GPTConfig(8, 8, 1, 2, 8))
    opt = torch.optim.AdamW(model.parameters())
    return store.save(directory, 1, dist_state.training_state(model, opt), {"step": 1}, rank=0)


class Exec:
    def __reduce__(self):
        return (exec, ("raise SystemExit('executed')",))


def test_the_metadata_unpickler_accepts_a_real_checkpoint_and_refuses_anything_else(tmp_path):
    path = real_checkpoint(tmp_path)
    honest = (path / ".metadata").read_bytes()
    assert "model.wte.weight" in dist_state.stored_tensors(dist_state.read_metadata(path))
    metadata = pickle.loads(honest)  # the test trusts its own file
    metadata.planner_data = {"payload": Evil(tmp_path / "PWNED")}  # a valid index carrying a payload
    payloads = {"os.system": pickle.dumps(Evil(tmp_path / "PWNED")), "builtins.exec": pickle.dumps(Exec()),
                "inside real metadata": pickle.dumps(metadata)}
    for what, payload in payloads.items():
        (path / ".metadata").write_bytes(payload)
        with pytest.raises(dist_state.RefusedPickle, match="it references"):
            dist_state.read_metadata(path)
        assert not (tmp_path / "PWNED").exists(), what
    escape = pickle.loads(honest)
    next(iter(escape.storage_data.values())).relative_path = "../elsewhere.distcp"
    (path / ".metadata").write_bytes(pickle.dumps(escape))
    with pytest.raises(dist_state.RefusedPickle, match="outside its directory"):
        dist_state.read_metadata(path)


# ------------------------------------------------------------------ multi-process: resharding, a killed save, export

REWARD_MODULE = '''
def text_score(response, answer):
    """Deterministic and arbitrary: spreads rewards over [0, 1] so every group has an advantage."""
    return (sum(map(ord, response)) % 11) / 10
'''

# Makes every rank hang inside DCP's writer once its step-4 shards are on disk (before .metadata),
# then says so with a file, so the test can SIGKILL the job mid-write. No hook in the trainer.
HANG_IN_WRITER = '''
import os, sys, time
from pathlib import Path
from torch.distributed.checkpoint import FileSystemWriter
from gradnorm.train import main

honest = FileSystemWriter.write_data

def write_then_hang(self, plan, planner):
    written = honest(self, plan, planner)
    if "ckpt_step4." in str(self.path):
        Path(os.environ["HANG_MARKERS"], os.environ["RANK"]).touch()
        time.sleep(600)
    return written

FileSystemWriter.write_data = write_then_hang
sys.exit(main())
'''


def launch(cmd: list[str], env: dict) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout}\n{proc.stderr[-4000:]}"


def kill_while_saving(cmd: list[str], env: dict, markers: Path, world_size: int) -> None:
    psutil = pytest.importorskip("psutil")
    job = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while len(list(markers.iterdir())) < world_size:
            assert job.poll() is None, job.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "no rank reached the step-4 save"
            time.sleep(0.05)
        for process in [*psutil.Process(job.pid).children(recursive=True), psutil.Process(job.pid)]:
            process.send_signal(signal.SIGKILL)  # workers first: nothing gets to clean up
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: output dir} of the five launches, plus what the killed run left before its resume."""
    pytest.importorskip("transformers")
    from tiny_models import build_tiny_llama

    base = tmp_path_factory.mktemp("checkpoints")
    model = build_tiny_llama(base / "tiny-llama", seed=0)
    (base / "ckpt_test_rewards.py").write_text(REWARD_MODULE)
    (base / "hang_in_writer.py").write_text(HANG_IN_WRITER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HANG_MARKERS": str(base / "markers"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(base), os.environ.get("PYTHONPATH")]))}
    flags = ["--model", str(model), "--prompts", "examples/arithmetic.jsonl", "--reward", "ckpt_test_rewards:text_score",
             "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "16", "--eval-prompts", "2",
             "--beta", "0.05", "--steps", "4", "--save-every", "2", "--seed", "1", "--no-plot"]

    def torchrun(script, out, parallel, *extra):
        return torchrun_command(2, *flags, "--parallel", parallel, "--output-dir", str(out), *extra, script=script)

    def from_step_2(source, name):  # a copy of a run as it was after its step-2 checkpoint
        shutil.copytree(source, base / name, ignore=shutil.ignore_patterns("ckpt_step4", "final"))
        return base / name

    out = {"model": model, "fsdp2": base / "fsdp2"}
    out["ddp-to-fsdp2"] = killed = base / "ddp-to-fsdp2"
    (base / "markers").mkdir()
    # Independent launches overlap (each writes its own directory): the run killed at its step-4
    # save beside the FSDP2 run, then the two resumes of the FSDP2 run's step-2 checkpoint.
    with ThreadPoolExecutor(1) as beside:
        killing = beside.submit(kill_while_saving, torchrun(base / "hang_in_writer.py", killed, "ddp"), env,
                                base / "markers", world_size=2)
        launch(torchrun("gradnorm/train.py", out["fsdp2"], "fsdp"), env)
        out["fsdp2-to-1"] = from_step_2(out["fsdp2"], "fsdp2-to-1")
        out["fsdp2-to-ddp"] = from_step_2(out["fsdp2"], "fsdp2-to-ddp")
        launch_all([[sys.executable, "gradnorm/train.py", *flags, "--output-dir", str(out["fsdp2-to-1"]), "--resume"],
                    torchrun("gradnorm/train.py", out["fsdp2-to-ddp"], "ddp", "--resume")], ROOT, env)
        killing.result()
    out["after the kill"] = {"entries": sorted(p.name for p in killed.iterdir() if "ckpt" in p.name),
                             "torn": sorted(p.name for p in (killed / ".ckpt_step4.tmp").iterdir()),
                             "latest": store.latest_checkpoint(killed),
                             "metrics": metrics(killed)}
    launch(torchrun("gradnorm/train.py", killed, "fsdp", "--resume"), env)
    return out


RESUMED = ["fsdp2-to-1", "fsdp2-to-ddp", "ddp-to-fsdp2"]


@pytest.mark.slow
@pytest.mark.parametrize("name", RESUMED)
def test_a_resumed_run_matches_the_uninterrupted_one_on_any_world_size_and_parallel(runs, name):
    reference, resumed = runs["fsdp2"], runs[name]
    assert_same_steps(resumed, reference, steps=(3, 4))  # rollouts, loss, grad norm, rewards...
    for got, want in zip(metrics(resumed)[2:], metrics(reference)[2:]):
        assert want["kl"] > 0  # the reference policy is in play, so a wrong one would show
        assert_close(got["kl"], want["kl"], rtol=1e-5, atol=1e-9)
    want = store.read_tensors(reference / "ckpt_step4", "model")
    got = store.read_tensors(resumed / "ckpt_step4", "model")
    assert got.keys() == want.keys()
    for key in want:  # the weights after step 4's update, which no metric of step 4 sees
        assert_close(got[key], want[key], rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.slow
def test_ddp_and_fsdp2_runs_agree_before_the_kill(runs):
    killed = {m["step"]: m for m in runs["after the kill"]["metrics"]}
    reference = {m["step"]: m for m in metrics(runs["fsdp2"])}
    for step in (1, 2, 3):
        assert killed[step]["rollout_digest"] == reference[step]["rollout_digest"]
        assert_close(killed[step]["grad_norm"], reference[step]["grad_norm"], rtol=1e-5, atol=0)


@pytest.mark.slow
def test_a_save_killed_mid_write_leaves_the_previous_checkpoint_and_resume_skips_it(runs):
    after = runs["after the kill"]
    assert after["entries"] == [".ckpt_step4.tmp", "ckpt_step2"]  # step 4 never got its name
    assert "__0_0.distcp" in after["torn"] and ".metadata" not in after["torn"]  # killed mid-write
    assert after["latest"].name == "ckpt_step2"
    resumed = runs["ddp-to-fsdp2"]
    assert sorted(p.name for p in resumed.iterdir() if "ckpt" in p.name) == ["ckpt_step2", "ckpt_step4"]
    assert store.read_run_state(resumed / "ckpt_step4", required=("step",))["step"] == 4


def logprobs_of(model, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    from gradnorm.models.hf import response_logprobs

    with torch.no_grad():
        return response_logprobs(model.eval(), tokens, prompt_len)[0]


@pytest.mark.slow
def test_the_exported_policy_reloads_with_transformers_and_scores_like_the_trained_one(runs, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gradnorm import export
    from gradnorm.models.hf import load_causal_lm, load_tokenizer

    final = runs["fsdp2"] / "final"
    assert (final / "model.safetensors").exists() and not list(final.glob("*.bin"))
    exported = AutoModelForCausalLM.from_pretrained(final)
    assert exported.config.use_cache
    tokenizer = load_tokenizer(str(runs["model"]))
    assert AutoTokenizer.from_pretrained(final)("12+34=?")["input_ids"] == tokenizer("12+34=?")["input_ids"]

    trained = load_causal_lm(str(runs["model"]), tokenizer.pad_token_id)
    initial = logprobs_of(trained, tokens := torch.randint(4, 60, (4, 12), generator=torch.Generator().manual_seed(0)), 5)
    trained.load_state_dict(store.read_tensors(runs["fsdp2"] / "ckpt_step4", "model"))
    want = logprobs_of(trained, tokens, 5)
    assert_close(logprobs_of(exported, tokens, 5), want)  # the export is the trained policy...
    assert (want - initial).abs().max() > 1e-3  # ...and training moved it (a stale export would fail)

    assert export.main([str(runs["fsdp2"]), "--out", str(tmp_path / "converted")]) == 0
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "converted")
    assert_close(logprobs_of(converted, tokens, 5), want)


@pytest.mark.slow
def test_an_fsdp2_save_adds_far_less_than_a_shard_to_rank_0_while_gathering_adds_the_whole_state(monkeypatch):
    """benchmarks/checkpoint_memory.py on a smaller model: the kernel's high-water mark of rank 0's
    resident memory, reset just before the save (exact, no sampling), so only the qualitative fact
    is asserted, with wide margins."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak resident set")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # spawned ranks import the script by name
    import checkpoint_memory

    gathered, sharded = (checkpoint_memory.measure(method, 2, n_layer=2, n_embd=512) for method in ("gathered", "sharded"))
    assert gathered["peak_extra_mb"] > 0.9 * gathered["full_state_mb"]  # the control: the measurement sees a gather
    assert sharded["peak_extra_mb"] < 0.25 * sharded["rank0_shard_mb"]
    print(f"rank 0's peak extra memory: gathered {gathered['peak_extra_mb']:.1f} MB, sharded "
          f"{sharded['peak_extra_mb']:.1f} MB (full state {gathered['full_state_mb']:.1f} MB)")
