"""The audit's splits beyond (W, A, sharding), each read exactly against an oracle written longhand.

- Token budget: ranks cut greedily into microbatches of at most B tokens hold different numbers of
  microbatches; the old mean and a loss divided by A_r are read as 1/(W A_r N[r,m]) and
  1/(A_r N); the control: the fix stays 1/N while A_r differs by rank.
- Packing: a per-row mean over packs gives every token of a row 1/(S |row|), a per-sequence mean
  by sequence_ids 1/(S |o_i|); the command calls the first SKEWED and says why.
- Context parallelism, both layouts: a per-chunk mean is 1/(W A N[r,m,c]); the fix with the factor
  K is 1/N under a mean over dp x cp, and the control, a sum over the group, is K/N.
- Pipeline: a schedule averaging per-microbatch means is 1/(W A P N[r,m,p]); the fix under a
  summing schedule is 1/N, under an averaging one (the control) 1/(P N).
- Masked tokens: a loss that drops truncated and rejected tokens but divides by every generated
  token weighs each kept token N_kept/N_resp times too little, and the report says so.
- GSPO and CISPO on policy are `sequence` and `token`; bad flag combinations are one error line.

Each oracle loops over ranks, microbatches, rows and positions; none calls gradnorm's weights.
"""


import pytest
import torch
from tests.helpers.audit_command import run, verdict_of
from torch.testing import assert_close

from gradnorm.audit import conventions, decide, masking, measurement, splits, synthetic
from gradnorm.audit.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BATCH = synthetic.synthetic_minibatch(48, group_size=6, max_new_tokens=40, seed=1)
S, T = BATCH.mask.shape
LENGTHS = [int(n) for n in BATCH.mask.sum(-1)]
N = sum(LENGTHS)


def contiguous_ranks(world_size):
    """Rank r holds sequences [r S/W, (r+1) S/W)."""
    per = S // world_size
    return [list(range(r * per, (r + 1) * per)) for r in range(world_size)]


def surrogate_sum(logp, old_logp, advantages, mask):
    """sum -rho A M: derivative -A per counted token at ratio 1 (advantages per row or per token)."""
    adv = advantages if advantages.dim() == mask.dim() else advantages.unsqueeze(-1)
    return -torch.where(mask, torch.exp(logp - old_logp) * adv, 0.0).sum()


# --- 1. token budget -------------------------------------------------------------------------------

def budget_plan_longhand(world_size, budget):
    plan = []
    for held in contiguous_ranks(world_size):
        microbatches, current, load = [], [], 0
        for i in held:
            if current and load + LENGTHS[i] > budget:
                microbatches.append(current)
                current, load = [], 0
            current.append(i)
            load += LENGTHS[i]
        microbatches.append(current)
        plan.append(microbatches)
    return plan


def fix_divided_by_accum(logp, old_logp, advantages, mask, *, num_tokens, world_size, accum_steps):
    """w = 1/(A_r N): the fix, then divided by this rank's own number of microbatches."""
    return surrogate_sum(logp, old_logp, advantages, mask) / num_tokens * world_size / accum_steps


def test_token_budget_weights_are_read_per_rank_count():
    world_size, budget = 3, 120
    plan = budget_plan_longhand(world_size, budget)
    counts = [len(rank) for rank in plan]
    assert len(set(counts)) > 1  # ranks run different numbers of microbatches
    built = splits.token_budget_plan("contiguous", BATCH.mask.sum(-1), world_size, budget)
    assert [[mb.tolist() for mb in rank] for rank in built] == plan
    layout = splits.build("budget", built, BATCH.mask.sum(-1), T, splits.Loop())
    old, fix, by_accum = (torch.zeros(S, T, dtype=torch.float64) for _ in range(3))
    for rank in plan:
        for mb in rank:
            local_tokens = sum(LENGTHS[i] for i in mb)
            for i in mb:
                for t in range(LENGTHS[i]):
                    old[i, t] = 1 / (world_size * len(rank) * local_tokens)
                    fix[i, t] = 1 / N
                    by_accum[i, t] = 1 / (len(rank) * N)
    assert_close(measurement.measure(conventions.microbatch_token_mean, BATCH, layout).weights, old,
                 rtol=1e-12, atol=0)
    assert_close(measurement.measure(conventions.token_sum_over_global_count, BATCH, layout).weights, fix,
                 rtol=1e-12, atol=0)
    read = measurement.measure(fix_divided_by_accum, BATCH, layout).weights
    assert_close(read, by_accum, rtol=1e-12, atol=0)
    assert (read - fix / max(counts)).abs().max() > 0.1 / N  # the control: no one factor covers every rank


def test_the_command_names_a_division_by_the_ranks_microbatch_count(capsys):
    args = ["gradnorm.audit.conventions:token_sum_over_global_count", "--world-size", "8", "--microbatch-tokens",
            "64", "--accum-steps", "1"]
    code, out, _ = run(capsys, *args, "--scale-by-accum")
    line = verdict_of(out)
    assert code == 1 and line.startswith("verdict: SKEWED") and "this rank's number of microbatches" in line
    code, out, _ = run(capsys, *args)  # the control: the fix as returned
    assert code == 0 and verdict_of(out).startswith("verdict: INVARIANT")


# --- 2. packing ------------------------------------------------------------------------------------

def packed_rows_longhand(microbatch, row_length):
    rows, fill = [[]], 0
    for i in microbatch:
        if fill + LENGTHS[i] > row_length:
            rows.append([])
            fill = 0
        rows[-1].append(i)
        fill += LENGTHS[i]
    return rows


@pytest.mark.parametrize("world_size, accum_steps", [(2, 2), (3, 1)])
def test_packed_rows_per_row_and_per_sequence_means(world_size, accum_steps):
    row_length = 90
    plan = [[torch.tensor(held[m * len(held) // accum_steps : (m + 1) * len(held) // accum_steps])
             for m in range(accum_steps)] for held in contiguous_ranks(world_size)]
    layout = splits.build("packed", plan, BATCH.mask.sum(-1), T, splits.Loop(), pack=row_length,
                          axes=frozenset({"pack"}))
    row_mean, per_sequence = torch.zeros(S, T, dtype=torch.float64), torch.zeros(S, T, dtype=torch.float64)
    for rank in plan:
        for mb in rank:
            for row in packed_rows_longhand(mb.tolist(), row_length):
                row_tokens = sum(LENGTHS[i] for i in row)
                for i in row:
                    for t in range(LENGTHS[i]):
                        row_mean[i, t] = 1 / (S * row_tokens)
                        per_sequence[i, t] = 1 / (S * LENGTHS[i])
    assert any(len(row) > 1 for rank in plan for mb in rank for row in packed_rows_longhand(mb.tolist(), row_length))
    read = measurement.measure(conventions.row_mean_over_packs, BATCH, layout).weights
    assert_close(read, row_mean, rtol=1e-12, atol=0)
    assert_close(measurement.measure(conventions.sequence_mean_inside_packs, BATCH, layout).weights, per_sequence,
                 rtol=1e-12, atol=0)
    assert (read - per_sequence).abs().max() > 0.5 * per_sequence.max()  # the control: packing moves the row mean


def test_the_command_says_a_per_row_mean_over_packs_is_skewed_and_why(capsys):
    code, out, err = run(capsys, "gradnorm.audit.conventions:row_mean_over_packs", "--pack", "256")
    line = verdict_of(out)
    assert code == 1 and err == "" and line.startswith("verdict: SKEWED")
    assert "invariant on unpacked rows, where it equals gradnorm's `sequence`" in line
    assert "a per-row mean over packs" in line
    for name in ("sequence_mean_inside_packs", "token_sum_over_global_count"):  # the controls
        code, out, _ = run(capsys, f"gradnorm.audit.conventions:{name}", "--pack", "256")
        assert code == 0 and verdict_of(out).startswith("verdict: INVARIANT"), name


# --- 3. context parallelism ------------------------------------------------------------------------

def chunk_columns_longhand(rank, cp, layout):
    if layout == "contiguous":
        size = T // cp
        return list(range(rank * size, (rank + 1) * size))
    size = T // (2 * cp)
    return list(range(rank * size, (rank + 1) * size)) + list(range((2 * cp - 1 - rank) * size, (2 * cp - rank) * size))


@pytest.mark.parametrize("cp_layout", splits.CP_LAYOUTS)
def test_context_parallel_chunk_mean_and_the_fix(cp_layout):
    world_size, cp = 2, 2
    plan = [[torch.tensor(held)] for held in contiguous_ranks(world_size)]
    layout = splits.build("cp", plan, BATCH.mask.sum(-1), T, splits.Loop(), context_parallel=cp, cp_layout=cp_layout,
                          axes=frozenset({"cp"}))
    chunk = torch.zeros(S, T, dtype=torch.float64)
    for rank in plan:
        for mb in rank:
            for c in range(cp):
                columns = chunk_columns_longhand(c, cp, cp_layout)
                tokens = sum(1 for i in mb.tolist() for t in columns if t < LENGTHS[i])
                for i in mb.tolist():
                    for t in columns:
                        if t < LENGTHS[i]:
                            chunk[i, t] = cp / (world_size * cp * len(rank) * tokens)  # x K, mean over W*K
    assert_close(measurement.measure(conventions.context_parallel_chunk_mean, BATCH, layout).weights, chunk,
                 rtol=1e-12, atol=0)
    fix = BATCH.mask.double() / N
    assert_close(measurement.measure(conventions.token_sum_over_global_count, BATCH, layout).weights, fix,
                 rtol=1e-12, atol=0)
    summed = splits.build("cp", plan, BATCH.mask.sum(-1), T, splits.Loop(cp_reduction="sum"), context_parallel=cp,
                          cp_layout=cp_layout, axes=frozenset({"cp"}))
    # The control: summed over the group, the factor K is one too many.
    assert_close(measurement.measure(conventions.token_sum_over_global_count, BATCH, summed).weights, cp * fix,
                 rtol=1e-12, atol=0)


def test_the_command_on_context_parallelism(capsys):
    args = ["gradnorm.audit.conventions:token_sum_over_global_count", "--context-parallel", "2"]
    code, out, _ = run(capsys, *args)
    assert code == 0 and verdict_of(out).startswith("verdict: INVARIANT")
    code, out, _ = run(capsys, *args, "--cp-reduction", "sum")  # the control
    assert code == 1 and "K = 2 times too large" in verdict_of(out)
    code, out, _ = run(capsys, "gradnorm.audit.conventions:context_parallel_chunk_mean", "--context-parallel", "2")
    assert code == 1 and verdict_of(out).startswith("verdict: SKEWED")


# --- 4. pipeline -----------------------------------------------------------------------------------

def test_a_pipeline_schedule_that_sums_or_averages():
    world_size, accum_steps, stages = 2, 2, 3
    plan = [[torch.tensor(held[: len(held) // 2]), torch.tensor(held[len(held) // 2 :])]
            for held in contiguous_ranks(world_size)]
    averaged = splits.build("pp", plan, BATCH.mask.sum(-1), T, splits.Loop(pipeline_combine="mean"),
                            pipeline_microbatches=stages, axes=frozenset({"pipeline"}))
    summed = splits.build("pp", plan, BATCH.mask.sum(-1), T, splits.Loop(pipeline_combine="sum"),
                          pipeline_microbatches=stages, axes=frozenset({"pipeline"}))
    old = torch.zeros(S, T, dtype=torch.float64)
    for rank in plan:
        for mb in rank:
            members = mb.tolist()
            size = len(members) // stages
            for p in range(stages):
                part = members[p * size : (p + 1) * size]
                tokens = sum(LENGTHS[i] for i in part)
                for i in part:
                    for t in range(LENGTHS[i]):
                        old[i, t] = 1 / (world_size * accum_steps * stages * tokens)
    assert_close(measurement.measure(conventions.pipeline_mean_of_token_means, BATCH, averaged).weights, old,
                 rtol=1e-12, atol=0)
    fix = BATCH.mask.double() / N
    assert_close(measurement.measure(conventions.token_sum_over_global_count, BATCH, summed).weights, fix,
                 rtol=1e-12, atol=0)
    # The control: the same fix under an averaging schedule weighs every token 1/P as much.
    assert_close(measurement.measure(conventions.token_sum_over_global_count, BATCH, averaged).weights, fix / stages,
                 rtol=1e-12, atol=0)


def test_the_command_on_a_pipeline(capsys):
    args = ["gradnorm.audit.conventions:token_sum_over_global_count", "--pipeline-combine"]
    code, out, _ = run(capsys, *args, "sum")
    assert code == 0 and verdict_of(out).startswith("verdict: INVARIANT")
    code, out, _ = run(capsys, *args, "mean")  # the control
    assert code == 1 and "the schedule's mean divides every weight by P = 2" in verdict_of(out)


# --- 5. masked tokens ------------------------------------------------------------------------------

def drops_masked(logp, old_logp, advantages, mask, *, truncated, rejected, num_tokens, world_size):
    """Drops truncated responses and rejected tokens, and divides by the kept count: w = 1/N_kept."""
    keep = mask & ~truncated.unsqueeze(-1) & ~rejected
    return surrogate_sum(logp, old_logp, advantages, keep) / num_tokens * world_size


def drops_but_counts_them(logp, old_logp, advantages, mask, *, truncated, rejected, num_response_tokens, world_size):
    """Drops them from the sum, not from the denominator: w = 1/N_resp on every kept token."""
    keep = mask & ~truncated.unsqueeze(-1) & ~rejected
    return surrogate_sum(logp, old_logp, advantages, keep) / num_response_tokens * world_size


def test_masked_tokens_and_what_the_denominator_counts(capsys):
    batch = masking.with_masked_tokens(BATCH, "none", seed=1)
    kept, generated = 0, 0
    truncated_rows = set()
    for g in range(batch.num_groups):  # the longest response of each group runs to T
        rows = list(range(g * batch.group_size, (g + 1) * batch.group_size))
        truncated_rows.add(max(rows, key=lambda i: (LENGTHS[i], -i)))
    right, counting = torch.zeros(S, T, dtype=torch.float64), torch.zeros(S, T, dtype=torch.float64)
    for i in range(S):
        length = T if i in truncated_rows else LENGTHS[i]
        generated += length
        kept += sum(1 for t in range(length) if i not in truncated_rows and not batch.rejected[i, t])
    for i in range(S):
        for t in range(T):
            if t < LENGTHS[i] and i not in truncated_rows and not batch.rejected[i, t]:
                right[i, t], counting[i, t] = 1 / kept, 1 / generated
    assert set(torch.nonzero(batch.truncated).flatten().tolist()) == truncated_rows
    assert int(batch.response.sum()) == generated and int(batch.mask.sum()) == kept < generated
    plans = {"reference": [[torch.arange(S)]], "2x2": [[torch.arange(0, 12), torch.arange(12, 24)],
                                                       [torch.arange(24, 36), torch.arange(36, 48)]]}
    good = decide.audit_plans(drops_masked, batch, plans)
    assert_close(good.results[1].weights, right, rtol=1e-12, atol=0)
    assert good.masked.counts_dropped is False and good.exit_code == 0
    bad = decide.audit_plans(drops_but_counts_them, batch, plans)
    assert_close(bad.results[1].weights, counting, rtol=1e-12, atol=0)
    assert bad.masked.counts_dropped is True and bad.exit_code == 1
    assert bad.masked.ratio == (pytest.approx(kept / generated), pytest.approx(kept / generated))
    # The command says it, and the control (the fix that ignores the declaration) leaks onto them.
    code, out, _ = run(capsys, f"{__name__}:drops_but_counts_them", "--count-masked", "none")
    assert code == 1 and verdict_of(out).startswith("verdict: MISCOUNTS: the denominator COUNTS the") and "COUNTS the" in out
    code, out, _ = run(capsys, f"{__name__}:drops_masked", "--count-masked", "none")
    assert code == 0 and "leaves out the" in verdict_of(out)
    code, out, _ = run(capsys, "gradnorm.audit.conventions:token_sum_over_global_count", "--count-masked", "none")
    assert code == 1 and "LEAKS onto tokens outside the mask or declared dropped" in verdict_of(out)


# --- 6. the catalogue's newcomers, bad flags, time ---------------------------------------------------

def test_gspo_and_cispo_on_policy():
    plans = {"reference": [[torch.arange(S)]], "3x2": [[torch.arange(r * 16 + m * 8, r * 16 + m * 8 + 8)
                                                         for m in range(2)] for r in range(3)]}
    sequence = torch.zeros(S, T, dtype=torch.float64)
    for i in range(S):
        for t in range(LENGTHS[i]):
            sequence[i, t] = 1 / (S * LENGTHS[i])
    gspo = decide.audit_plans(conventions.gspo_sequence_ratio, BATCH, plans)
    assert_close(gspo.results[1].weights, sequence, rtol=1e-12, atol=0)
    cispo = decide.audit_plans(conventions.cispo_clipped_weight, BATCH, plans)
    assert_close(cispo.results[1].weights, BATCH.mask.double() / N, rtol=1e-12, atol=0)
    assert (gspo.equals, cispo.equals) == ("sequence", "token") and gspo.invariant and cispo.invariant


LOSS = "gradnorm.audit.conventions:token_sum_over_global_count"
BAD_FLAGS = {
    "pack with context parallel": (["--pack", "128", "--context-parallel", "2"], "--pack with --context-parallel"),
    "pipeline with a budget": (["--pipeline-combine", "sum", "--microbatch-tokens", "128"], "--microbatch-tokens"),
    "cp reduction alone": (["--cp-reduction", "sum"], "needs --context-parallel"),
    "cp layout alone": (["--cp-layout", "two-chunk"], "needs --context-parallel"),
    "pipeline count alone": (["--pipeline-microbatches", "3"], "needs --pipeline-combine"),
    "row shorter than a response": (["--pack", "10"], "below --max-new-tokens"),
    "budget below a response": (["--microbatch-tokens", "10"], "below --max-new-tokens"),
    "too many cp ranks": (["--context-parallel", "40"], "needs --max-new-tokens"),
    "unknown masked kind": (["--count-masked", "padding"], "padding"),
}


@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_bad_flag_combinations_are_one_error_line(case, capsys):
    argv, says = BAD_FLAGS[case]
    code, out, err = run(capsys, LOSS, *argv)
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert says in err, err


def test_every_catalogue_entry_audits_with_its_flags(capsys):
    for name in conventions.CATALOGUE:
        code = main([f"gradnorm.audit.conventions:{name}", *conventions.AXES.get(name, ())])
        out, err = capsys.readouterr()
        assert code in (0, 1) and err == "" and out.splitlines()[-1].startswith("verdict: "), (name, err)
