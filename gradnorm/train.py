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

``--help`` documents every flag (they come from ``gradnorm.trainer.config.TrainConfig``). Rank 0
alone prints and writes ``output-dir/``: ``config.json``, ``metrics.jsonl`` (one JSON object per
optimizer step), ``warmup.json`` and ``learning_curve.png``. Every rank writes its shards of
``ckpt_step{N}/`` (gradnorm.trainer.checkpoint: sharded, atomic, resumable on any W and --parallel), and a
Hugging Face run ends with its policy in ``final/`` (gradnorm.export, ``from_pretrained``-ready).

One optimizer step (S = prompts-per-step * group-size sequences, the same for every W):

 1. Rollout. Prompts come from a generator seeded by (seed, step), and sequence i samples its
    tokens from uniforms seeded by (seed, step, i), so the global batch depends on the seed, the
    step and the weights, never on W, A or the sharding (gradnorm.trainer.rollout). Under --rollouts
    sharded (the default) each rank samples only its share of the prompt groups, with the
    unwrapped model, and one all_gather of tokens and rewards gives every rank the whole batch;
    replicated has every rank sample all of it. On CPU each process runs with --cpu-threads
    threads (1 by default) because matmuls round differently with different thread counts, and a
    one-ulp difference in a logit can flip a sampled token between W=1 and W=2.
 2. Shard. ``step.plan_for`` (``core.sharding``) assigns sequences to ranks and microbatches
    from the global lengths, the same plan on every rank; each rank keeps plan[rank].
 3. Accumulate: the fix, written out in ``step_gradient`` below as examples/drop_in_ddp.py writes
    it. ``comm.global_counts`` counts this rank's tokens and all-reduces the counts ONCE (skipped by
    local and a constant, which need no counts); then for each microbatch the forward, GRPO's
    per-token losses l (``core.grpo``), each token's weight w from those global counts
    (``core.denominators.token_weights``: 1/N for the token mean), and the backward of
    sum(W * w * l), W undoing DDP's mean, under DDP's no_sync except the last. A microbatch's
    forward runs in chunks of rows of similar response length, each cut to its longest response
    (``chunks.score_by_length``): the same log-probs inside the response mask, without most of the
    padding.
 4. Step. Clip the global gradient norm (the logged grad_norm is the norm before clipping, the
    same on every rank after DDP's all-reduce). One more all-reduce, of 6 float64 sums (J, tokens,
    pg loss, KL, clipped tokens, entropy) followed by each rank's stop vote, comes back as a
    ``step.StepStats``: every logged statistic a global, token-weighted value comparable across W
    and A, and the stop every rank agreed on. It is a logging collective, the same in every mode,
    separate from the normalization's count all-reduce. Then AdamW steps, or every rank skips a
    step whose loss or gradient is not finite.
 5. Log and checkpoint. A last tiny all-reduce (MAX of 3 floats) gives the slowest rank's phase
    times: where a step's time goes (``gradnorm.trainer.logs.phases.PhaseTimer``: time_rollout_s,
    time_forward_backward_s, ...) is logged every step. After SIGTERM or SIGINT (to torchrun or to
    any one rank) every rank checkpoints at the end of the same step and exits with 143 or 130; a
    second signal exits at once (``gradnorm.trainer.guards.preemption``). The run log
    (``logs.runlog.RunLog``) owns the phase times, metrics.jsonl, the console and the loggers;
    the checkpointer (``checkpoint.checkpointer.Checkpointer``) decides when to save.

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
    mu iterations); old log-probs are then computed once per rollout, before any update, and each
    rank scores 1/W of the rows, balanced by cost, then sends every row's log-probs to the rank
    that trains on it (``scoring.score``), as it does the reference's.
 7. Constant learning rate, no schedule; groups whose rewards are all equal simply get zero
    advantage (no dynamic sampling as in DAPO).
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from collections.abc import Callable
from pathlib import Path

if __name__ == "__main__":  # Ctrl-C while torch imports: exit 130 quietly (preemption takes over in main)
    import signal

    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))

try:  # run as a script, sys.path[0] is gradnorm/; a plain checkout has no installed package
    import gradnorm  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from gradnorm.cli import pipes
from gradnorm.core.accumulate import no_sync
from gradnorm.core.denominators import token_weights
from gradnorm.core.grpo import NUM_STATS, grpo_token_losses, stat_sums
from gradnorm.core.sharding import Plan, passes
from gradnorm.dist import comm, wrap
from gradnorm.trainer import engine_rollout, scoring, start
from gradnorm.trainer import step as steps  # `step` is the loop's counter
from gradnorm.trainer.checkpoint import export
from gradnorm.trainer.checkpoint.checkpointer import Checkpointer, RunState, saved_record
from gradnorm.trainer.config import TrainConfig
from gradnorm.trainer.guards import failures, launch, preemption
from gradnorm.trainer.policy import Policy, build_policy
from gradnorm.trainer.record import record
from gradnorm.trainer.rollout import generate_rollout
from gradnorm.trainer.logs.runlog import RunLog
from gradnorm.trainer.session import Session


def step_gradient(dp_model: torch.nn.Module, policy: Policy, batch: steps.Minibatch, plan: Plan, cfg: TrainConfig,
                  ctx: comm.DistContext, autocast: Callable[[], contextlib.AbstractContextManager],
                  phase: Callable[[str], contextlib.AbstractContextManager] = lambda name: contextlib.nullcontext(),
                  ) -> torch.Tensor:
    """This rank's part of one step's gradient; returns its statistic sums (NUM_STATS,) float64.

    The fix, as examples/drop_in_ddp.py writes it for any loop: count, ONE all-reduce, then for
    each microbatch the forward, the per-token losses l, their weights w times W, and the
    backward under no_sync. Summed over ranks (DDP's mean times W) and microbatches, the gradient
    is that of J = sum w * l * M over the whole minibatch, for any W, A and sharding. The loop
    then clips and steps; ``tests/distributed/test_trainer_step.py`` checks this function against
    a longhand oracle. ``phase(name)`` times the counts and the forward/backward (``RunLog.phase``).
    """
    rows, mask, W = batch.rollout, batch.loss_mask, ctx.world_size  # mask (S, R): the tokens the loss takes
    A = len(plan[ctx.rank])  # this rank's microbatches: only `local` divides by it
    # ALGO LOGIC: count this rank's tokens and all-reduce them ONCE: every rank now holds the
    # minibatch's global counts (N, and per sequence and group). local and a constant need none: None.
    with phase("counts"):
        counts = comm.global_counts(plan[ctx.rank], mask.sum(-1), rows.group_ids, rows.num_groups, cfg.denominator)
    # Under FSDP2 on several ranks every forward is a collective: each pass makes the same number of calls.
    calls = (steps.pass_calls(plan, rows.lengths, rows.prompt_len, cfg.pack)
             if W > 1 and wrap.is_fsdp(dp_model) else [None] * passes(plan))
    sums = torch.zeros(NUM_STATS, dtype=torch.float64, device=mask.device)
    with phase("forward_backward"):
        for p, (idx, idle) in enumerate(steps.rank_passes(plan, ctx.rank)):  # idle passes weigh nothing
            mb_mask = torch.zeros_like(mask[idx]) if idle else mask[idx]  # (n, R)
            # only the last backward all-reduces the gradients; the others add into .grad
            with no_sync(dp_model, last=p == len(calls) - 1):
                with autocast():  # fp32 log-probs either way
                    logp, entropy = steps.score(policy, dp_model, rows, idx, cfg.pack, calls[p])  # (n, R)
                terms = grpo_token_losses(
                    logp, logp.detach() if batch.old_logp is None else batch.old_logp[idx], rows.advantages[idx],
                    ref_logp=None if batch.ref_logp is None else batch.ref_logp[idx], beta=cfg.beta,
                    clip_low=cfg.clip_low, clip_high=cfg.clip_high, kl_estimator=cfg.kl_estimator,
                    entropy=entropy.detach(),
                    importance_weight=None if batch.importance_weight is None else batch.importance_weight[idx])
                # ALGO LOGIC: w from the global counts (1/N for token), times W: DDP (and FSDP2) average
                # the ranks' gradients, (1/W) sum_r dL_r, so L_r = sum W * w * l * M gives
                # sum_r sum_tokens w * dl = dJ (core.denominators.rank_weights derives it)
                w = token_weights(mb_mask, rows.group_ids[idx], cfg.denominator, counts, world_size=W,
                                  accum_steps=max(A, 1), dtype=terms.loss.dtype)  # (n, R)
                loss = (W * w * torch.where(mb_mask, terms.loss, 0.0)).sum()
                loss.backward()
            sums += stat_sums(w, mb_mask, terms)
    return sums


def train(cfg: TrainConfig, ctx: comm.DistContext, ckpt_path: Path | None, run: RunState) -> None:
    """Build, then run the five steps of the module docstring for every optimizer step."""
    U = cfg.updates_per_rollout
    task, policy = build_policy(cfg, ctx.device, ctx.world_size, launch.local_ranks())
    model = policy.model
    # bf16 autocast around every forward pass (never the backward); log-softmax, loss weights and
    # statistics stay fp32/fp64 and counts int64 inside it, so the normalization is unchanged.
    amp_dtype = cfg.autocast_dtype(ctx.device.type)

    def autocast():
        return contextlib.nullcontext() if amp_dtype is None else torch.autocast(ctx.device.type, dtype=amp_dtype)

    start.start_or_resume(run, cfg, policy, task, ckpt_path, autocast)
    ref = None
    if cfg.beta > 0:  # the frozen reference: the policy after warm-up (on resume, the checkpoint's)
        ref = copy.deepcopy(model).requires_grad_(False).eval()
    # What the training forward goes through: DDP around the model, or the model itself (FSDP2
    # shards it in place, and one process needs no wrapper). Both wrappers average gradients over W.
    dp_model = wrap.wrap_policy(model, cfg.parallel, ctx, blocks=policy.blocks())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    checkpointer = Checkpointer(cfg, model, opt, ref, ctx)  # when to save, and saving
    if ckpt_path is not None:
        checkpointer.load(ckpt_path)
        comm.print0(f"resumed from {ckpt_path} at step {run.step}")
    # --rollout-engine vllm: this rank's vLLM engine, loaded with the weights the loop starts from
    # (the warm-up's or the checkpoint's, so it starts after the load)
    engine = engine_rollout.start(cfg, task, policy)
    if not cfg.builtin:
        comm.print0("sampling: an in-process vLLM engine per rank (gradnorm.trainer.engine_rollout)" if engine
                    else f"sampling: {policy.decoding(task.block_size)}")
        comm.print0(f"training forward: {policy.scoring(dp_model)}")

    rollout = old_logp = ref_logp = correction = None
    mismatch = {}  # engine vs trainer log-probs of the current rollout batch (--rollout-engine vllm)
    with RunLog(cfg, ctx, run, saved_record(ckpt_path)) as log:  # phase times, metrics.jsonl, console
        for step in run.steps(cfg.steps):
            # 1. Rollout: sampled once per rollout batch, then reused by its U updates.
            j = (step - 1) % U  # which update of the current rollout batch this is
            if j == 0 or rollout is None:
                with log.phase("rollout"), autocast():
                    # sharded: this rank samples its share of the groups, then one all_gather; replicated: all
                    share = dict(rank=ctx.rank, world_size=ctx.world_size) if cfg.rollouts == "sharded" else {}
                    rollout = (engine.generate if engine else generate_rollout)(policy, task, num_prompts=cfg.prompts_per_step * cfg.minibatches_per_rollout,
                                               group_size=cfg.group_size, seed=cfg.seed, step=step - j,
                                               temperature=cfg.temperature, scale_by_std=cfg.scale_adv_by_std, **share)
                # log-probs of the sampling policy (needed once samples are reused, and against an engine's)
                # and of the reference: each rank scores 1/W of the batch, then one all-to-all gives it
                # those of the rows it trains on (FSDP2 ranks call in lockstep)
                if U > 1 or ref is not None or engine:
                    with log.phase("scoring"), torch.no_grad(), autocast():
                        trained_rows = scoring.shares(rollout, cfg, ctx.world_size)  # [rank] -> its rows
                        sampled_logp, ref_logp = scoring.score(policy, [model if U > 1 or engine else None, ref],
                                                               rollout, trained_rows, ctx.rank, cfg.pack)
                    old_logp = sampled_logp if U > 1 else None  # on-policy, the loss's ratio stays exactly 1
                    if engine:  # the engine's log-probs are checked against the trainer's, never trusted
                        correction, mismatch = engine.check(rollout, sampled_logp, trained_rows[ctx.rank],
                                                            cfg.engine_correction, cfg.engine_ratio_cap)

            # 2. Shard: this rank's microbatches of the global minibatch.
            with log.phase("shard"):
                k = j % cfg.minibatches_per_rollout  # which minibatch of the rollout batch this step trains on
                span = slice(k * cfg.sequences_per_step, (k + 1) * cfg.sequences_per_step)
                batch = steps.Minibatch(rollout=rollout.groups(k * cfg.prompts_per_step, cfg.prompts_per_step),
                                        old_logp=None if old_logp is None else old_logp[span],
                                        ref_logp=None if ref_logp is None else ref_logp[span],
                                        rollout_digest=rollout.digest(), pad_id=policy.pad_id,
                                        **(engine_rollout.minibatch_fields(correction, span) if engine else {}))
                rows, plan = batch.rollout, steps.plan_for(batch, cfg, ctx.world_size)
                opt.zero_grad(set_to_none=True)

            # 3. Accumulate. THE FIX: count, one all-reduce of the counts, then every microbatch's
            # backward of W * w * l under no_sync, w from the global counts (``step_gradient`` above).
            sums = step_gradient(dp_model, policy, batch, plan, cfg, ctx, autocast, phase=log.phase)

            # 4. Step: clip the global norm; one all-reduce of the statistics (and the ranks' stop
            # votes); skip the update on every rank if anything is non-finite.
            with log.phase("optimizer"):
                grad_norm = wrap.clip_grad_norm(model, cfg.max_grad_norm)  # the norm before clipping
                stats = steps.reduce_stats(sums, with_kl=cfg.beta > 0)
                steps.apply_or_skip(opt, grad_norm, stats, run, step, cfg.max_skipped_steps)
                if engine:  # the next rollout samples from the weights this step produced
                    engine.sync(model)

            # 5. Log (rank 0) and checkpoint (every rank its shards).
            with log.phase("log"):
                line = log.step(record(step, stats, grad_norm, batch, plan, run.skipped, cfg, with_skew=ctx.is_main)
                                | mismatch,
                                tokens=stats.tokens)
            stop = stats.stop if step % U == 0 else None  # a stop waits for the end of a rollout batch
            with log.phase("checkpoint"):
                saved = checkpointer.save(run, stop, record=line, before=log.sync)
            if stop and (step < cfg.steps or checkpointer.abandons(step, stop)):
                raise preemption.Stopped(stop, step, saved)
            if run.in_a_row >= cfg.max_skipped_steps:
                raise failures.TrainingError(f"{run.in_a_row} steps in a row had a non-finite loss or gradient (last: step "
                                    f"{step}); the weights are unchanged since step {step - run.in_a_row}: lower --lr "
                                    "or check the reward, or raise --max-skipped-steps")
        if cfg.export_dir is not None:  # the trained Hugging Face policy, loadable with from_pretrained
            export.save_trained(model, task.tokenizer_hf, cfg.export_dir, ctx.is_main)


def main(argv: list[str] | None = None) -> int:
    """Read the config, check it, train: 0, or 2 for bad input and 1 for a failed run.

    The session holds rank 0's lock on output-dir, the process group and the failure ladder: each
    kind of failure is reported once there, in one line, with its exit code (``trainer.session``).
    """
    with Session() as session:
        with preemption.exit_at_once():  # nothing trained yet: a signal ends a wait for peers or for rank 0 now
            cfg = session.read_config(argv)
            ctx = session.join(cfg)
            cfg, ckpt_path = session.check(cfg)  # every rank's checks, then rank 0's decision, before any model
        train(cfg, ctx, ckpt_path, session.run)
    return session.exit_code


if __name__ == "__main__":
    pipes.survive_closed_stdout("the run goes on; its step lines are in metrics.jsonl")
    with preemption.catch_signals():  # SIGTERM, SIGINT: finish the step, checkpoint, exit 143 or 130
        code = main()
    if comm.launched_by_torchrun():  # everything is written, closed and torn down by now
        comm.exit_without_finalizing(code)  # not sys.exit: see its docstring (pytorch/pytorch#179291)
    sys.exit(code)
