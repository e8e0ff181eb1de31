"""GRPO with exact loss normalization, on any number of ranks: the trainer of gradnorm.

Run it from the repository root (after ``make install`` or ``pip install -e .``):

    # the main job: 2 CPU ranks over gloo, about 3 minutes on 2 cores
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 gradnorm/train.py
    # one process, no torchrun (the same run, to fp32 rounding)
    python gradnorm/train.py
    # the bug on purpose: per-microbatch means, ranks sorted by response length
    torchrun --standalone --nproc_per_node=2 gradnorm/train.py --loss-denominator local --shard length \\
        --grad-accum-steps 2 --output-dir runs/local
    # continue an interrupted run from its latest checkpoint
    torchrun --standalone --nproc_per_node=2 gradnorm/train.py --resume
    # on GPUs the backend is NCCL automatically (override with --backend, --device)
    torchrun --standalone --nproc_per_node=8 gradnorm/train.py
    # a Hugging Face model on a JSONL prompt file (pip install -e '.[hf]'; bf16 on CUDA), FSDP2
    torchrun --standalone --nproc_per_node=8 gradnorm/train.py --model Qwen/Qwen2.5-0.5B-Instruct \\
        --prompts examples/arithmetic.jsonl --parallel fsdp --max-new-tokens 128 --lr 1e-6

``--help`` documents every flag (they come from ``gradnorm.trainconfig.TrainConfig``). Rank 0
alone prints and writes ``output-dir/``: ``config.json``, ``metrics.jsonl`` (one JSON object per
optimizer step), ``warmup.json``, ``ckpt_step{N}.pt`` and ``learning_curve.png``.

One optimizer step (S = prompts-per-step * group-size sequences, the same for every W):

 1. Rollout. Every rank samples the whole global rollout batch with generators seeded from
    (seed, step), using the unwrapped model: the batch depends on the seed, the step and the
    weights, never on W, A or the sharding (gradnorm.rollout). On CPU each process runs with
    --cpu-threads threads (1 by default) because matmuls round differently with different thread
    counts, and a one-ulp difference in a logit can flip a sampled token between W=1 and W=2.
 2. Shard. ``sharding.make_plan(--shard, lengths, W, A)`` assigns sequences to ranks and
    microbatches; each rank keeps plan[rank].
 3. Accumulate. ``dist.comm.global_counts`` counts this rank's response tokens and all-reduces
    the count vector ONCE (the fix; skipped by local and a constant, which need no counts);
    ``update.accumulate_gradients`` backpropagates each microbatch's weighted loss with those
    counts, under DDP's no_sync except the last.
 4. Step. Clip the global gradient norm (the logged grad_norm is the norm before clipping, the
    same on every rank after DDP's all-reduce), AdamW step.
 5. Log and checkpoint. One more all-reduce of 6 float64 sums (J, tokens, pg loss, KL, clipped tokens, entropy)
    makes every logged statistic a global, token-weighted value comparable across W and A. It is a
    logging collective, the same in every mode, separate from the normalization's count all-reduce.
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
import sys
import time
from dataclasses import dataclass, field
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

from gradnorm import checkpointing, hfmodels, preemption
from gradnorm.dist import comm, wrap
from gradnorm.grpo import NUM_STATS, finalize_stats, grpo_token_losses
from gradnorm.prompts import PromptTask
from gradnorm.rollout import generate_rollout, sampled_reward, seeded_generator
from gradnorm.sharding import make_plan, tokens_per_rank
from gradnorm.tasks import RepeatTask
from gradnorm.tinygpt import GPTConfig, TinyGPT, response_logprobs, token_logprobs_and_entropy
from gradnorm.trainconfig import TrainConfig, parse_config
from gradnorm.update import accumulate_gradients

class TrainingError(RuntimeError):
    """A run that cannot go on (e.g. too many non-finite steps in a row); main prints it in one line."""


TIMING_KEYS = ("tokens_per_second", "elapsed_s", "max_memory_gib")
"""Measured metrics (wall time; CUDA memory): everything else in metrics.jsonl is a function of the config."""


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
    """The checkpoint --resume continues from; a one-line ValueError when there is none."""
    if not cfg.resume:
        return None
    path = checkpointing.latest_checkpoint(cfg.output_dir)
    if path is None:
        raise ValueError(f"--resume: no checkpoint ckpt_step*.pt in {cfg.output_dir}")
    return path


def open_metrics(path: Path, keep_through_step: int):
    """metrics.jsonl for appending, cut back to the steps <= ``keep_through_step`` (0: a fresh file)."""
    kept = []
    if keep_through_step > 0 and path.exists():
        kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= keep_through_step]
    path.write_text("".join(line + "\n" for line in kept))
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


def start_or_resume(cfg: TrainConfig, model: torch.nn.Module, task, ckpt_path: Path | None, autocast) -> tuple[RunState, dict | None]:
    """A fresh run (reward, warm-up, reward) or the checkpoint's weights and state; (state, checkpoint)."""
    if ckpt_path is not None:
        # on the CPU: RNG states must stay CPU tensors; load_state_dict copies the rest to the device
        ckpt = checkpointing.load(ckpt_path, required=checkpointing.TRAINER_KEYS)
        try:
            model.load_state_dict(ckpt["model"])
        except RuntimeError as err:
            raise ValueError(f"checkpoint {ckpt_path} holds a different model ({(str(err).splitlines() + [''])[1].strip()[:120]}); "
                             "resume with the --model (--n-layer/--n-head/--n-embd) it was trained with") from None
        return RunState(ckpt["step"], ckpt["warmup"], ckpt["elapsed_s"], ckpt.get("skipped_steps", 0),
                        ckpt.get("skipped_in_a_row", 0)), ckpt
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
    return RunState(warmup=warmup), None


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

    run, ckpt = start_or_resume(cfg, model, task, ckpt_path, autocast)
    ref = None
    if cfg.beta > 0:  # the frozen reference: the policy after warm-up
        ref = copy.deepcopy(model).requires_grad_(False).eval()
        if ckpt is not None:
            if "ref_model" not in ckpt:
                raise ValueError(f"checkpoint {ckpt_path} holds no reference policy (it was trained with --beta 0); "
                                 "resume it with --beta 0")
            ref.load_state_dict(ckpt["ref_model"])
    # What the training forward goes through: DDP around the model, or the model itself (FSDP2
    # shards it in place, and one process needs no wrapper). Both wrappers average gradients over W.
    dp_model = wrap.wrap_policy(model, cfg.parallel, ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    if ckpt is not None:
        wrap.load_optimizer_state(model, opt, ckpt["optimizer"])
        checkpointing.set_rng_state(ckpt["rng"])
        comm.print0(f"resumed from {ckpt_path} at step {run.step}")
        del ckpt

    metrics = None
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps({**cfg.to_dict(), "world_size": W}, indent=2) + "\n")
        (out / "warmup.json").write_text(json.dumps(run.warmup, indent=2) + "\n")
        metrics = open_metrics(out / "metrics.jsonl", run.step)
        if ckpt_path is None:  # a fresh run replaces the old one's files, so --resume never mixes runs
            for stale in out.glob("ckpt_step*.pt"):
                stale.unlink()
    bar = tqdm(total=cfg.steps, initial=run.step, disable=not (ctx.is_main and sys.stderr.isatty()),
               desc="GRPO", dynamic_ncols=True)
    elapsed0 = run.elapsed_s
    t0 = t_prev = time.perf_counter()
    rollout = old_logp = ref_logp = None
    for step in range(run.step + 1, cfg.steps + 1):
        # 1. Rollout: sampled once per rollout batch, then reused by its U updates.
        j = (step - 1) % U  # which update of the current rollout batch this is
        if j == 0 or rollout is None:
            with wrap.gathered_for_sampling(model) as sampler, autocast():
                rollout = generate_rollout(sampler, task, num_prompts=cfg.prompts_per_step * cfg.minibatches_per_rollout,
                                           group_size=cfg.group_size, seed=cfg.seed, step=step - j,
                                           temperature=cfg.temperature, scale_by_std=cfg.scale_adv_by_std)
            with torch.no_grad(), autocast():  # log-probs of the sampling policy, needed once samples are reused
                old_logp = score(model, rollout.tokens, P)[0] if U > 1 else None
                ref_logp = score(ref, rollout.tokens, P)[0] if ref is not None else None
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
                logp, entropy = score(dp_model, mb.tokens[idx], P)  # fp32 even under autocast
            return grpo_token_losses(
                logp, logp.detach() if mb_old is None else mb_old[idx], mb.advantages[idx],
                ref_logp=None if mb_ref is None else mb_ref[idx], beta=cfg.beta, clip_low=cfg.clip_low,
                clip_high=cfg.clip_high, kl_estimator=cfg.kl_estimator, entropy=entropy.detach(),
            )

        # 3. Accumulate: THE all-reduce of counts (the fix), then every microbatch's backward.
        opt.zero_grad(set_to_none=True)
        counts = comm.global_counts(plan[ctx.rank], mb.lengths, mb.group_ids, mb.num_groups, cfg.denominator)
        sums = accumulate_gradients(dp_model, plan[ctx.rank], mb.mask, mb.group_ids, counts,
                                    cfg.denominator, token_losses, W)

        # 4. Step: clip the global norm; skip the update on every rank if anything is non-finite.
        grad_norm = wrap.clip_grad_norm(model, cfg.max_grad_norm)  # global, also over FSDP shards
        # The logging collective; its tail carries the ranks' stop votes (gradnorm.preemption).
        reduced = comm.all_reduce_sum(torch.cat([sums, preemption.votes(sums)])).cpu()
        stats = finalize_stats(reduced[:NUM_STATS], with_kl=cfg.beta > 0)
        apply_or_skip(opt, grad_norm, stats, run, step, cfg)

        # 5. Log (rank 0) and checkpoint.
        now = time.perf_counter()
        record = step_record(step, stats, grad_norm, mb, lengths, plan, rollout, run,
                             tokens_per_second=stats["tokens"] / max(now - t_prev, 1e-9),
                             elapsed_s=elapsed0 + now - t0, device=ctx.device)
        t_prev = now
        run.step, run.elapsed_s = step, record["elapsed_s"]
        if ctx.is_main:
            write_record(metrics, bar, record, cfg)
        stop = preemption.agreed(reduced[NUM_STATS:]) if step % U == 0 else None  # only between rollouts
        if step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0) or stop:
            save_checkpoint(out, model, opt, ref, run, ctx)
        if stop and step < cfg.steps:
            raise preemption.Stopped(stop, step, checkpointing.checkpoint_path(out, step))
        if run.in_a_row >= cfg.max_skipped_steps:
            raise TrainingError(f"{run.in_a_row} steps in a row had a non-finite loss or gradient (last: step {step}); "
                                "the weights are unchanged since step " f"{step - run.in_a_row}: lower --lr or "
                                "check the reward, or raise --max-skipped-steps")
    bar.close()
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
    """Append the record to metrics.jsonl and show it (progress bar, or a line every --log-every steps)."""
    metrics.write(json.dumps(record) + "\n")
    metrics.flush()
    bar.update(1)
    bar.set_postfix(reward=f"{record['reward_mean']:.3f}", tok_s=f"{record['tokens_per_second']:.0f}")
    step = record["step"]
    if bar.disable and (step % cfg.log_every == 0 or step == cfg.steps):
        print(f"step {step}/{cfg.steps} reward {record['reward_mean']:.3f} loss {record['loss']:.4f} "
              f"grad_norm {record['grad_norm']:.4f} tokens/s {record['tokens_per_second']:.0f}", flush=True)


def save_checkpoint(out: Path, model, opt, ref, run: RunState, ctx: comm.DistContext) -> None:
    """Write ckpt_step{N}.pt atomically (rank 0); under FSDP every rank takes part in gathering it."""
    model_state, opt_state = wrap.full_state_dict(model), wrap.optimizer_state(model, opt)
    if ctx.is_main:
        checkpointing.save_atomic({
            "model": model_state, "optimizer": opt_state, "step": run.step,
            "rng": checkpointing.rng_state(), "warmup": run.warmup, "elapsed_s": run.elapsed_s,
            "skipped_steps": run.skipped, "skipped_in_a_row": run.in_a_row,
            **({"ref_model": ref.state_dict()} if ref is not None else {}),
        }, checkpointing.checkpoint_path(out, run.step))


def summarize(out: Path, plot: bool) -> None:
    """Print the run's outcome and draw its learning curve (rank 0)."""
    from gradnorm.curves import read_metrics, write_learning_curve

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
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    try:  # every rank validates the same flags; rank 0 says what is wrong, before any model exists
        cfg = parse_config(argv, world_size, prog="gradnorm/train.py")
        ckpt_path = resume_point(cfg)
    except ValueError as err:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(cfg.cpu_threads)
    ctx = comm.setup(backend=None if cfg.backend == "auto" else cfg.backend,
                         device=None if cfg.device == "auto" else cfg.device, timeout_s=cfg.timeout_s)
    try:
        train(cfg, ctx, ckpt_path)
    except (ValueError, TrainingError) as err:  # bad checkpoint, bad reward, NaN after NaN: one line, no traceback
        if ctx.is_main:
            print(f"error: {err}", file=sys.stderr, flush=True)
        return 1
    except preemption.Stopped as stopped:  # SIGTERM or SIGINT: checkpointed, one line, 143 or 130
        if ctx.is_main:
            print(stopped, file=sys.stderr, flush=True)
        return stopped.exit_code
    finally:
        comm.teardown()
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
