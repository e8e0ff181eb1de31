"""GRPO with exact loss normalization, on any number of ranks: the trainer of gradnorm.

Run it from the repository root (after ``make install`` or ``pip install -e .``):

    # the main job: 2 CPU ranks over gloo, about a minute on 2 cores
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 gradnorm/train.py
    # one process, no torchrun (the same run, to fp32 rounding)
    python gradnorm/train.py
    # the bug on purpose: per-microbatch means, ranks sorted by response length
    torchrun --standalone --nproc_per_node=2 gradnorm/train.py --loss-denominator local --shard length \\
        --grad-accum-steps 2 --output-dir runs/local
    # continue an interrupted run from its latest checkpoint (the flags that define it must match)
    torchrun --standalone --nproc_per_node=2 gradnorm/train.py --resume
    # start over in a directory that holds a run (it is kept until the new run has a checkpoint)
    torchrun --standalone --nproc_per_node=2 gradnorm/train.py --overwrite
    # on GPUs the backend is NCCL automatically (override with --backend, --device)
    torchrun --standalone --nproc_per_node=8 gradnorm/train.py
    # a Hugging Face model on a JSONL prompt file (pip install -e '.[hf]'; bf16 on CUDA), FSDP2
    torchrun --standalone --nproc_per_node=8 gradnorm/train.py --model Qwen/Qwen2.5-0.5B-Instruct \\
        --prompts examples/arithmetic.jsonl --parallel fsdp --max-new-tokens 128 --lr 1e-6

``--help`` documents every flag (they come from ``gradnorm.trainconfig.TrainConfig``). Rank 0
alone prints and writes ``output-dir/``: ``config.json``, ``metrics.jsonl`` (one JSON object per
optimizer step), ``warmup.json`` and ``learning_curve.png``. Every rank writes its shards of
``ckpt_step{N}/`` (gradnorm.checkpointing: sharded, atomic, resumable on any W and --parallel), and a
Hugging Face run ends with its policy in ``final/`` (gradnorm.export, ``from_pretrained``-ready).

One optimizer step (S = prompts-per-step * group-size sequences, the same for every W):

 1. Rollout. Prompts come from a generator seeded by (seed, step), and sequence i samples its
    tokens from uniforms seeded by (seed, step, i), so the global batch depends on the seed, the
    step and the weights, never on W, A or the sharding (gradnorm.rollout). Under --rollouts
    sharded (the default) each rank samples only its share of the prompt groups, with the
    unwrapped model, and one all_gather of tokens and rewards gives every rank the whole batch;
    replicated has every rank sample all of it. On CPU each process runs with --cpu-threads
    threads (1 by default) because matmuls round differently with different thread counts, and a
    one-ulp difference in a logit can flip a sampled token between W=1 and W=2.
 2. Shard. ``sharding.make_plan(--shard, lengths, W, A)`` assigns sequences to ranks and
    microbatches; each rank keeps plan[rank].
 3. Accumulate. ``dist.comm.global_counts`` counts this rank's response tokens and all-reduces
    the count vector ONCE (the fix; skipped by local and a constant, which need no counts);
    ``update.accumulate_gradients`` backpropagates each microbatch's weighted loss with those
    counts, under DDP's no_sync except the last. A microbatch's forward runs in chunks of rows of
    similar response length, each cut to its longest response (``scoring.score_by_length``): the
    same log-probs inside the response mask, without most of the padding.
 4. Step. Clip the global gradient norm (the logged grad_norm is the norm before clipping, the
    same on every rank after DDP's all-reduce), AdamW step.
 5. Log and checkpoint. One more all-reduce of 6 float64 sums (J, tokens, pg loss, KL, clipped tokens, entropy)
    makes every logged statistic a global, token-weighted value comparable across W and A. It is a
    logging collective, the same in every mode, separate from the normalization's count all-reduce.
    A last tiny one (MAX of 3 floats) gives the slowest rank's phase times: where a step's time goes
    (``gradnorm.phases``: time_rollout_s, time_forward_backward_s, ...) is logged every step.
    It also carries each rank's stop vote: after SIGTERM or SIGINT (to torchrun or to any one
    rank) every rank checkpoints at the end of the same step and exits with 143 or 130; a second
    signal exits at once (gradnorm.preemption).

Where this GRPO departs from the papers (DeepSeekMath's GRPO, DAPO, Dr GRPO):

 1. No pretrained model: a tiny transformer starts from scratch, and a short supervised warm-up
    on the task's demonstrations (--warmup-steps, replicated on every rank so the starting policy
    is independent of W) stands in for pretraining. RL alone is slow from random weights. The
    reward is logged before and after the warm-up (warmup.json) so its share of the final reward
    is visible; GRPO takes it the rest of the way.
 2. The default denominator is the global token mean (DAPO); GRPO's per-sequence mean is
    --loss-denominator sequence, Dr GRPO's constant is a number.
 3. beta = 0 by default: no reference policy, no KL term (DAPO, Dr GRPO). With beta > 0 the
    reference is the policy after warm-up and the k3 estimator enters the loss, not the reward.
 4. Clip-higher (DAPO): ratios are clipped to [1 - 0.2, 1 + 0.28].
 5. The reward is shaped (partial credit for the right letter and the right length, halved
    without EOS; gradnorm.tasks), so a weak policy still sees a gradient.
 6. One optimizer step per rollout by default: fully on-policy, the importance ratio is exactly 1
    and the clip never fires. --minibatches-per-rollout and --epochs give PPO-style reuse (GRPO's
    mu iterations); old log-probs are then computed once per rollout, before any update.
 7. Constant learning rate, no schedule; groups whose rewards are all equal simply get zero
    advantage (no dynamic sampling as in DAPO).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

if __name__ == "__main__":  # Ctrl-C while torch imports: exit 130 quietly (preemption takes over in main)
    import signal

    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))

try:  # run as a script, sys.path[0] is gradnorm/; a plain checkout has no installed package
    import gradnorm  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from tqdm import tqdm

from gradnorm import checkpointing, export, failures, hfmodels, memory, phases, preemption, preflight, rundir
from gradnorm.dist import comm, wrap
from gradnorm.dist import state as dist_state
from gradnorm.grpo import NUM_STATS, finalize_stats, grpo_token_losses
from gradnorm.prompts import PromptTask
from gradnorm.rollout import generate_rollout, sampled_reward, seeded_generator
from gradnorm.scoring import score_by_length
from gradnorm.sharding import make_plan, tokens_per_rank
from gradnorm.tasks import RepeatTask
from gradnorm.tinygpt import GPTConfig, TinyGPT, response_logprobs, token_logprobs_and_entropy
from gradnorm.trainconfig import TrainConfig, parse_config
from gradnorm.update import accumulate_gradients

class TrainingError(RuntimeError):
    """A run that cannot go on (e.g. too many non-finite steps in a row); main prints it in one line."""


TIMING_KEYS = ("tokens_per_second", "elapsed_s", "max_memory_gib", *phases.METRIC_KEYS)
"""Measured metrics (wall time; CUDA memory): everything else in metrics.jsonl is a function of the config."""
BAR_PHASES = ("rollout", "forward_backward", "optimizer")
"""Phase times (gradnorm.phases) the progress bar shows beside the reward."""


def warm_up(model: TinyGPT, task: RepeatTask, cfg: TrainConfig) -> None:
    """Next-token training on demonstrations (masked token-mean NLL), run identically on every rank.

    No DDP and no collectives: every rank computes the same full batch bit for bit, so the policy
    GRPO starts from is the same for every W.
    """
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warmup_lr, weight_decay=0.0)
    g = seeded_generator(cfg.seed, "warmup")
    for _ in range(cfg.warmup_steps):
        tokens, loss_mask = (t.to(device) for t in task.demonstrations(cfg.warmup_batch, g))
        logp, _ = token_logprobs_and_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        mask = loss_mask[:, 1:]
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def resume_point(cfg: TrainConfig) -> Path | None:
    """The checkpoint --resume continues from, once the run it continues is known to match.

    One-line ValueErrors: no checkpoint; a flag that defines the run differs from config.json
    (``rundir.compare_resumed``); --steps not beyond the checkpoint's step.
    """
    if not cfg.resume:
        return None
    path = checkpointing.latest_checkpoint(cfg.output_dir)
    if path is None:
        old = " (its ckpt_step*.pt files are the single-file format of earlier versions)" \
            if any(Path(cfg.output_dir).glob("ckpt_step*.pt")) else ""
        raise ValueError(f"--resume: no complete checkpoint ckpt_step*/ in {cfg.output_dir}{old}")
    rundir.compare_resumed(cfg, rundir.read_config(Path(cfg.output_dir)))
    done = re.match(r"ckpt_step(\d+)", path.name)
    if done and int(done.group(1)) >= cfg.steps:
        raise ValueError(f"--resume: {path} is at step {done.group(1)} and --steps is {cfg.steps}: nothing to do; "
                         "raise --steps to continue the run")
    return path


def open_metrics(path: Path, keep_through_step: int):
    """metrics.jsonl for appending, cut back to the steps <= ``keep_through_step`` (0: a fresh file).

    A resumed run's file may be missing (it starts again after the checkpoint's step), end in a
    torn line (a crash mid-write) or hold lines that are not records (edited by hand): those lines
    are dropped with a warning naming the file and the line. The cut file replaces the old one
    atomically, so a crash now loses nothing.
    """
    kept = []
    if keep_through_step > 0 and not path.exists():
        print(f"warning: {path} is missing; it starts again at step {keep_through_step + 1}", file=sys.stderr, flush=True)
    elif keep_through_step > 0:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for number, line in enumerate(lines, start=1):
            try:
                step = json.loads(line)["step"] if line.strip() else None
            except (ValueError, KeyError, TypeError):
                step = "bad"
            if step is None:
                continue
            if not isinstance(step, int) or isinstance(step, bool):
                why = "a torn last line (the run stopped mid-write)" if number == len(lines) else "not a metrics record"
                print(f"warning: {path}:{number}: dropped {why}", file=sys.stderr, flush=True)
            elif step <= keep_through_step:
                kept.append(line)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return open(path, "a")


def build_policy(cfg: TrainConfig, device: torch.device):
    """(task, model, score): the built-in task and TinyGPT, or JSONL prompts and a Hugging Face model.

    ``score(model, tokens, P)`` is the model's ``response_logprobs``; the rollout picks the
    matching sampler itself (``rollout.sampler_for``).
    """
    if cfg.builtin:
        task = RepeatTask(max_new_tokens=cfg.max_new_tokens)
        torch.manual_seed(cfg.seed)
        model = TinyGPT(GPTConfig(task.vocab_size, task.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd))
        return task, model.to(device), response_logprobs
    tokenizer = hfmodels.load_tokenizer(cfg.model)
    task = PromptTask.from_file(cfg.prompts, tokenizer, cfg.reward, cfg.max_new_tokens)
    model = hfmodels.load_causal_lm(cfg.model, task.tokenizer.pad_id, device=device,
                                    gradient_checkpointing=cfg.gradient_checkpointing)
    return task, model.train(), hfmodels.response_logprobs


@dataclass
class RunState:
    """Where a run stands: what a checkpoint restores besides the weights, optimizer and RNGs."""

    step: int = 0
    """Optimizer steps done."""
    warmup: dict = field(default_factory=dict)
    """The warm-up's record (warmup.json)."""
    elapsed_s: float = 0.0
    """Seconds of GRPO before this process started (a resumed run continues the clock)."""
    skipped: int = 0
    """Steps skipped for a non-finite loss or gradient, in all."""
    in_a_row: int = 0
    """The same, in a row up to the last step."""


RUN_FIELDS = tuple(f.name for f in fields(RunState))


def start_or_resume(cfg: TrainConfig, model: torch.nn.Module, task, ckpt_path: Path | None, autocast) -> RunState:
    """A fresh run (reward, warm-up, reward), or the checkpoint's counters (its tensors are loaded
    by ``load_checkpoint`` once the model is wrapped, into this run's shards)."""
    if ckpt_path is not None:
        run = checkpointing.read_run_state(ckpt_path, required=RUN_FIELDS)
        return RunState(**{k: run[k] for k in RUN_FIELDS})
    t = time.perf_counter()
    with autocast():
        before = sampled_reward(model, task, cfg.eval_prompts, cfg.temperature, cfg.seed)
    after = before
    if cfg.builtin:  # a Hugging Face model starts from its own (pretrained) weights
        warm_up(model, task, cfg)
        with autocast():
            after = sampled_reward(model, task, cfg.eval_prompts, cfg.temperature, cfg.seed)
    warmup = {"steps": cfg.warmup_steps if cfg.builtin else 0, "reward_before": before,
              "reward_after": after, "seconds": time.perf_counter() - t}
    comm.print0(f"warm-up: {warmup['steps']} supervised steps, sampled reward {before:.3f} -> {after:.3f}")
    return RunState(warmup=warmup)


def train(cfg: TrainConfig, ctx: comm.DistContext, ckpt_path: Path | None) -> None:
    """Build, then run the five steps of the module docstring for every optimizer step."""
    W, A, U = ctx.world_size, cfg.grad_accum_steps, cfg.updates_per_rollout
    out = Path(cfg.output_dir)
    task, model, score = build_policy(cfg, ctx.device)
    P = task.prompt_len
    # bf16 autocast around every forward pass (never the backward); log-softmax, loss weights and
    # statistics stay fp32/fp64 and counts int64 inside it, so the normalization is unchanged.
    amp_dtype = cfg.autocast_dtype(ctx.device.type)

    def autocast():
        return contextlib.nullcontext() if amp_dtype is None else torch.autocast(ctx.device.type, dtype=amp_dtype)

    run = start_or_resume(cfg, model, task, ckpt_path, autocast)
    ref = None
    if cfg.beta > 0:  # the frozen reference: the policy after warm-up (on resume, the checkpoint's)
        ref = copy.deepcopy(model).requires_grad_(False).eval()
    # What the training forward goes through: DDP around the model, or the model itself (FSDP2
    # shards it in place, and one process needs no wrapper). Both wrappers average gradients over W.
    dp_model = wrap.wrap_policy(model, cfg.parallel, ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    if ckpt_path is not None:  # weights, AdamW state, reference and RNGs, resharded to this W and --parallel
        load_checkpoint(ckpt_path, model, opt, ref, ctx)
        comm.print0(f"resumed from {ckpt_path} at step {run.step}")

    metrics = None
    if ctx.is_main:  # the directory is locked and an old run set aside by main (gradnorm.rundir)
        out.mkdir(parents=True, exist_ok=True)
        rundir.write_config(out, cfg, W, run.step)
        (out / "warmup.json").write_text(json.dumps(run.warmup, indent=2) + "\n")
        metrics = open_metrics(out / "metrics.jsonl", run.step)
    bar = tqdm(total=cfg.steps, initial=run.step, disable=not (ctx.is_main and sys.stderr.isatty()),
               desc="GRPO", dynamic_ncols=True)
    elapsed0 = run.elapsed_s
    timer = phases.PhaseTimer(ctx.device)  # laps between the numbered steps: where a step's time goes
    t0 = t_prev = timer.last
    rollout = old_logp = ref_logp = None
    for step in range(run.step + 1, cfg.steps + 1):
        # 1. Rollout: sampled once per rollout batch, then reused by its U updates.
        j = (step - 1) % U  # which update of the current rollout batch this is
        if j == 0 or rollout is None:
            # sharded: this rank samples its share of the groups, then one all_gather; replicated: all of them
            share = dict(rank=ctx.rank, world_size=W) if cfg.rollouts == "sharded" else dict(rank=0, world_size=1)
            with wrap.gathered_for_sampling(model) as sampler, autocast():
                rollout = generate_rollout(sampler, task, num_prompts=cfg.prompts_per_step * cfg.minibatches_per_rollout,
                                           group_size=cfg.group_size, seed=cfg.seed, step=step - j,
                                           temperature=cfg.temperature, scale_by_std=cfg.scale_adv_by_std, **share)
            timer.lap("rollout")
            with torch.no_grad(), autocast():  # log-probs of the sampling policy, needed once samples are reused
                old_logp = score_by_length(score, model, rollout.tokens, P, rollout.lengths)[0] if U > 1 else None
                ref_logp = score_by_length(score, ref, rollout.tokens, P, rollout.lengths)[0] if ref is not None else None
            timer.lap("scoring")
        mb_index = j % cfg.minibatches_per_rollout
        mb = rollout.groups(mb_index * cfg.prompts_per_step, cfg.prompts_per_step)
        rows = slice(mb_index * cfg.sequences_per_step, (mb_index + 1) * cfg.sequences_per_step)
        mb_old = None if old_logp is None else old_logp[rows]
        mb_ref = None if ref_logp is None else ref_logp[rows]

        # 2. Shard: this rank's microbatches of the global minibatch.
        lengths = mb.lengths.cpu()
        plan = make_plan(cfg.shard, lengths, W, A)

        def token_losses(idx):  # the forward pass of one microbatch, through DDP or FSDP
            with autocast():
                logp, entropy = score_by_length(score, dp_model, mb.tokens[idx], P, mb.lengths[idx])  # fp32 even under autocast
            return grpo_token_losses(
                logp, logp.detach() if mb_old is None else mb_old[idx], mb.advantages[idx],
                ref_logp=None if mb_ref is None else mb_ref[idx], beta=cfg.beta, clip_low=cfg.clip_low,
                clip_high=cfg.clip_high, kl_estimator=cfg.kl_estimator, entropy=entropy.detach(),
            )

        # 3. Accumulate: THE all-reduce of counts (the fix), then every microbatch's backward.
        opt.zero_grad(set_to_none=True)
        timer.lap("shard")
        counts = comm.global_counts(plan[ctx.rank], mb.lengths, mb.group_ids, mb.num_groups, cfg.denominator)
        timer.lap("counts")
        sums = accumulate_gradients(dp_model, plan[ctx.rank], mb.mask, mb.group_ids, counts,
                                    cfg.denominator, token_losses, W)
        timer.lap("forward_backward")

        # 4. Step: clip the global norm; skip the update on every rank if anything is non-finite.
        grad_norm = wrap.clip_grad_norm(model, cfg.max_grad_norm)  # global, also over FSDP shards
        # The logging collective; its tail carries the ranks' stop votes (gradnorm.preemption).
        reduced = comm.all_reduce_sum(torch.cat([sums, preemption.votes(sums)])).cpu()
        stats = finalize_stats(reduced[:NUM_STATS], with_kl=cfg.beta > 0)
        apply_or_skip(opt, grad_norm, stats, run, step, cfg)
        timer.lap("optimizer")

        # 5. Log (rank 0) and checkpoint.
        now = timer.last  # the step ends at its last lap, so its phase times add up to its wall time
        phase_times = timer.split(comm.all_reduce_max)  # rank 0's laps, and the max over ranks (a tiny all-reduce)
        record = step_record(step, stats, grad_norm, mb, lengths, plan, rollout, run,
                             tokens_per_second=stats["tokens"] / max(now - t_prev, 1e-9),
                             elapsed_s=elapsed0 + now - t0, device=ctx.device)
        record.update(phase_times)
        t_prev = now
        run.step, run.elapsed_s = step, record["elapsed_s"]
        if ctx.is_main:
            write_record(metrics, bar, record, cfg)
        timer.lap("log")
        stop = preemption.agreed(reduced[NUM_STATS:]) if step % U == 0 else None  # only between rollouts
        if step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0) or stop:
            save_checkpoint(out, model, opt, ref, run, ctx)
        timer.lap("checkpoint")
        if stop and step < cfg.steps:
            raise preemption.Stopped(stop, step, checkpointing.checkpoint_dir(out, step))
        if run.in_a_row >= cfg.max_skipped_steps:
            raise TrainingError(f"{run.in_a_row} steps in a row had a non-finite loss or gradient (last: step {step}); "
                                "the weights are unchanged since step " f"{step - run.in_a_row}: lower --lr or "
                                "check the reward, or raise --max-skipped-steps")
    bar.close()
    comm.print0(f"last checkpoint written in {timer.peek('checkpoint'):.2f} s (each line of metrics.jsonl has the one before it)")
    if cfg.export_dir is not None:  # the trained Hugging Face policy, loadable with from_pretrained
        export.save_trained(model, task.tokenizer_hf, cfg.export_dir, ctx.is_main)
    if ctx.is_main:
        metrics.close()
        summarize(out, cfg.plot)


def apply_or_skip(opt: torch.optim.Optimizer, grad_norm: torch.Tensor, stats: dict, run: RunState, step: int,
                  cfg: TrainConfig) -> None:
    """Step the optimizer, or skip the update when the loss or the gradient is not finite.

    grad_norm (after DDP's all-reduce) and the stats (all-reduced) are the same on every rank, so
    every rank takes the same decision without another collective. NaN never reaches the weights.
    """
    if bool(torch.isfinite(grad_norm)) and all(math.isfinite(v) for v in stats.values()):
        opt.step()
        run.in_a_row = 0
        return
    opt.zero_grad(set_to_none=True)
    run.skipped, run.in_a_row = run.skipped + 1, run.in_a_row + 1
    comm.print0(f"warning: step {step}: non-finite loss or gradient (loss {stats['loss']}, grad_norm "
                f"{float(grad_norm)}); skipped the update ({run.in_a_row} in a row, "
                f"--max-skipped-steps {cfg.max_skipped_steps})", file=sys.stderr)


def step_record(step, stats, grad_norm, mb, lengths, plan, rollout, run: RunState, *, tokens_per_second: float,
                elapsed_s: float, device: torch.device) -> dict:
    """One line of metrics.jsonl: global statistics of the step (non-finite values as null)."""
    record = {
        "step": step, "loss": stats["loss"], "grad_norm": float(grad_norm),
        "reward_mean": float(mb.rewards.mean()), "exact_match": float((mb.rewards == 1.0).float().mean()),
        "response_len_mean": float(lengths.float().mean()), "response_len_max": int(lengths.max()),
        "tokens": stats["tokens"], "tokens_per_rank": tokens_per_rank(plan, lengths),
        **{k: stats[k] for k in ("pg_loss", "kl", "clipfrac", "entropy") if k in stats},
        "rollout_digest": rollout.digest(), "skipped_steps": run.skipped,
        "tokens_per_second": tokens_per_second, "elapsed_s": elapsed_s,
        **({"max_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30} if device.type == "cuda" else {}),
    }
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


def write_record(metrics, bar, record: dict, cfg: TrainConfig) -> None:
    """Append the record to metrics.jsonl and show it (progress bar, or a line every --log-every steps).

    A skipped step's non-finite statistics are None in the record; they print as null.
    """
    metrics.write(json.dumps(record) + "\n")
    metrics.flush()

    def show(key: str, spec: str) -> str:
        return "null" if record.get(key) is None else format(record[key], spec)

    timed = [p for p in BAR_PHASES if record.get(f"time_{p}_s") is not None]  # where the step's time went
    bar.update(1)
    bar.set_postfix(reward=show("reward_mean", ".3f"), tok_s=show("tokens_per_second", ".0f"),
                    **{p: show(f"time_{p}_s", ".2f") + "s" for p in timed})
    step = record["step"]
    if bar.disable and (step % cfg.log_every == 0 or step == cfg.steps):
        print(" ".join([f"step {step}/{cfg.steps} reward {show('reward_mean', '.3f')} loss {show('loss', '.4f')} "
                        f"grad_norm {show('grad_norm', '.4f')} tokens/s {show('tokens_per_second', '.0f')}",
                        *(f"{p} {show(f'time_{p}_s', '.3f')}s" for p in timed)]), flush=True)


def save_checkpoint(out: Path, model, opt, ref, run: RunState, ctx: comm.DistContext) -> None:
    """Write ckpt_step{N}/: every rank its own shards, in parallel, nothing gathered on one rank."""
    checkpointing.save(out, run.step, dist_state.training_state(model, opt, ref), asdict(run), ctx.rank)


def load_checkpoint(path: Path, model, opt, ref, ctx: comm.DistContext) -> None:
    """Load a checkpoint written on any W and --parallel into this run's (possibly sharded) model."""
    state = dist_state.training_state(model, opt, ref)  # this run's layout: the placeholders to fill
    checkpointing.load(path, state, ctx.rank)
    dist_state.apply_training_state(model, opt, ref, state)


def summarize(out: Path, plot: bool) -> None:
    """Print the run's outcome and draw its learning curve (rank 0)."""
    from gradnorm.curves import write_learning_curve
    from gradnorm.runs import read_metrics

    rows = read_metrics(out / "metrics.jsonl")
    last = rows[-10:]
    warmup = json.loads((out / "warmup.json").read_text())
    print(f"reward: {warmup['reward_before']:.3f} before warm-up, {warmup['reward_after']:.3f} after; "
          f"mean of the last {len(last)} steps {sum(r['reward_mean'] for r in last) / len(last):.3f} "
          f"(max 1.0); {rows[-1]['elapsed_s']:.0f} s of GRPO")
    if not plot:
        return
    try:
        print(f"learning curve: {write_learning_curve(out)}")
    except ImportError:
        print("learning curve skipped: matplotlib is not installed (pip install -e '.[notebooks]')")


def main(argv: list[str] | None = None) -> int:
    """Check everything, lock the run directory, train; 0, or 2 for bad input and 1 for a failed run."""
    rank, run_dir = preflight.error_rank(), None
    try:  # every rank checks the same flags, files and environment, before any model exists
        rank, world_size = preflight.launch_environment()
        cfg = parse_config(argv, world_size, prog="gradnorm/train.py")
        preflight.check_inputs(cfg)
        rundir.check(Path(cfg.output_dir), cfg.resume, cfg.overwrite)
        ckpt_path = resume_point(cfg)
        memory.check_fits(cfg, world_size, preflight.device_of(cfg), sharing=memory.local_ranks())
        if rank == 0:  # rank 0 alone writes output-dir
            run_dir = rundir.RunDir(cfg.output_dir)
            run_dir.open(cfg.resume, cfg.overwrite)
    except ValueError as err:
        if run_dir is not None:
            run_dir.close(succeeded=False)
        failures.report_error(str(err), rank)
        return 2
    succeeded = False
    try:
        torch.set_num_threads(cfg.cpu_threads)
        try:
            ctx = comm.setup(backend=None if cfg.backend == "auto" else cfg.backend,
                             device=None if cfg.device == "auto" else cfg.device, timeout_s=cfg.timeout_s)
        except (RuntimeError, ValueError) as err:  # the rendezvous failed (address, port, a peer that never came)
            failures.report_error(f"could not join the process group ({str(err).strip().splitlines()[0][:200]})", rank)
            return 1
        try:
            train(cfg, ctx, ckpt_path)
            succeeded = True
        except (ValueError, TrainingError, checkpointing.CheckpointError, torch.OutOfMemoryError, MemoryError) as err:
            # bad checkpoint, full disk, bad reward, non-finite logits, NaN after NaN, out of memory: one line
            step = None if isinstance(err, TrainingError) else failures.failed_step(err, train.__code__)  # it says
            failures.report_error(failures.explain(err, ctx.device, step), ctx.rank)
            return 1
        except preemption.Stopped as stopped:  # SIGTERM or SIGINT: checkpointed, one line, 143 or 130
            if ctx.is_main:
                print(stopped, file=sys.stderr, flush=True)
            return stopped.exit_code
        finally:
            comm.teardown()
    finally:
        if run_dir is not None:
            run_dir.close(succeeded)
    return 0


if __name__ == "__main__":
    with preemption.catch_signals():  # SIGTERM, SIGINT: finish the step, checkpoint, exit 143 or 130
        code = main()
    if comm.launched_by_torchrun():
        # Skip interpreter finalization under torchrun. A gloo worker thread may still be dropping
        # the last collective's tensors, which takes the GIL; during finalization that aborts the
        # process ("terminate called without an active exception", SIGABRT) now and then, and
        # torchrun reports the run as failed. Seen here under load; see pytorch/pytorch#179291.
        # Everything is written, closed and torn down by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
