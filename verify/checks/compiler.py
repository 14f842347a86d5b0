"""The compiler, checked on its own: the reference compiled as the case compiles it against the
same reference run eagerly. The sharded run is compared with the compiled reference, so that a
divergence there is the sharding's; a compiler bug that does not depend on sharding shows in both
compiled runs alike and would pass that comparison. Here it is reported, and named as the
compiler's.

The tolerance is derived from what a compiler may change in a graph (reference/fusion.py): the
eager run again with every operation of the compiled modules moved by that bound, with random
signs, gives the floor of each step and phase; a record may part from eager by NOISE_MULTIPLE
times it (the moves reach every record through later roundings, a sample: as the reduction floor,
verify/compare/tolerance.py), and never by less than the fp32 bound; the clip's total norm, which
no graph computes, by what its gradients part by (`norm_tolerance`), and the built-in losses, which
no graph computes either, by what their logits part by (`loss_tolerance`). Dropout under Inductor is not
comparable: Inductor draws its own random numbers, not eager's masks (both compiled runs draw the
same, so the sharded comparison stands).
"""

from __future__ import annotations

import math

import torch

from fsdp_verify.case import Case
from fsdp_verify.compare.comparators import Comparator, CompareContext, _finite_parts, _same_nonfinite
from fsdp_verify.compare.finding import Finding
from fsdp_verify.compare.tolerance import NOISE_MULTIPLE, Tolerance, bound_tolerance, measure, unit_roundoff
from fsdp_verify.trace import Trace

COMPARATOR = "CompiledVsEager"
# What a run computes; the initial parameters and buffers are built, not computed, and a
# resume's loaded state is a copy (the other comparators hold those exactly).
COMPUTED = ("logits", "loss", "grads", "grad_norm", "params", "optim_state")


def eager_case(case: Case) -> Case:
    return case.with_(compile=None, compile_fullgraph=False, compile_backend="inductor")


def not_comparable(case: Case) -> str | None:
    """Why compiled and eager runs of `case` cannot be compared, or None."""
    if case.compile_backend == "inductor" and case.model.dropout > 0:
        return (
            f"dropout {case.model.dropout}: Inductor draws its own random numbers, not eager's masks (the sharded run"
            " and the reference, both compiled, draw the same)"
        )
    return None


# A PyTorch bug (torch 2.13) that every case with these three ingredients meets: Dynamo turns a
# checkpoint into its `tag_activation_checkpoint` op, whose eager implementation runs the
# checkpoint with preserve_rng_state=False (the caller's True overridden, counting on Inductor's
# RNG functionalization), so under backend "eager", where no compiler pass runs, the backward's
# recomputation draws new dropout masks: the compiled gradients are those of a forward that never
# ran. Inductor draws its own masks (not comparable, above) and `aot_eager` replays the forward's.
# Found by sweep seed 4187 (cases 05692d89ad30, d9eb9d673e1d); regression 0c778baba209.
REDRAWN_DROPOUT_REPRO = "tests/upstream/test_compile_eager_backend_checkpoint_redraws_dropout.py"


def redraws_dropout(case: Case) -> bool:
    """Whether `case` has every ingredient of PyTorch's redrawn dropout (REDRAWN_DROPOUT_REPRO):
    the `eager` backend, activation checkpointing, dropout. Left out of the draw, as every known
    PyTorch bug is (a strict xfail tracks it); `check` still catches it when asked."""
    return case.compile_backend == "eager" and case.activation_checkpointing and case.model.dropout > 0


def compiler_hint(case: Case, first: Finding | None) -> str:
    """For a divergence of the compiled reference from eager: the known PyTorch bug the case has
    every ingredient of, where its gradients (or what follows from them) are the first to part;
    else nothing (the records alone do not say which operation the compiler changed)."""
    if first is None or first.phase != "compiler" or first.ok:
        return ""
    derived = first.step > 1 or not first.name.startswith(("logits.", "loss."))
    if redraws_dropout(case) and derived:
        return (
            f"this case has every ingredient of a known PyTorch bug: backend 'eager' recomputes a checkpointed"
            f" unit's dropout (p={case.model.dropout}) with a new mask in backward (Dynamo's checkpoint op overrides"
            f" preserve_rng_state=True), so the compiled gradients are those of masks the forward never drew;"
            f" `--compile-backend aot_eager` replays the forward's. Repro: {REDRAWN_DROPOUT_REPRO}"
        )
    return ""


def check_compiler(case: Case, compiled: Trace) -> list[Finding]:
    """Findings of phase "compiler": each record of the compiled reference `compiled` that parts
    from the eager reference by more than the fusion floor allows, or one passing finding that
    says how close the worst came."""
    from fsdp_verify.engines import engine_arithmetic
    from fsdp_verify.reference import train_reference
    from fsdp_verify.training.threads import rank_like_threads

    if case.compile is None or case.step is not None:
        return []
    why = not_comparable(case)
    if why is not None:
        return [
            Finding(0, "compiler", "<compiler>", True, "skipped", COMPARATOR, f"compiled against eager: n/a: {why}")
        ]
    arithmetic = engine_arithmetic(case.engine)
    with rank_like_threads():
        eager = train_reference(eager_case(case), arithmetic=arithmetic)

    def floor_run() -> list[Trace]:
        with rank_like_threads():
            return [train_reference(case, arithmetic=arithmetic, fusion=int(case.hash[:8], 16))]

    ctx = CompareContext(eager, floor_run)
    failures, worst = [], None
    for key in eager.keys_sorted():
        step, phase, name = key
        if phase not in COMPUTED or key not in compiled.records:
            continue
        ref, got = eager.records[key], compiled.records[key]
        if ref.shape != got.shape:
            failures.append(_failure(key, "shape", f"shape {tuple(got.shape)} compiled, {tuple(ref.shape)} eager"))
            continue
        if ref.is_floating_point() and not _same_nonfinite(ref, got) and not ctx.nonfinite_allowed(key, got):
            failures.append(_failure(key, "nonfinite", "infs or NaNs other than eager's"))
            continue
        dev = measure(*_finite_parts(ref, got))
        tol = bound_tolerance(ref.dtype)
        if dev.normwise > tol.limit and phase == "grad_norm":
            tol = norm_tolerance(case, step, eager, compiled) or tol
        elif dev.normwise > tol.limit and phase == "loss" and (held := loss_tolerance(case, step, eager, compiled)):
            tol = held  # None (a user's loss): the fusion floor, below
        elif dev.normwise > tol.limit:
            floor, _ = ctx.floor(key)
            if NOISE_MULTIPLE * floor > tol.limit:
                tol = Tolerance(
                    "calibrated",
                    NOISE_MULTIPLE * floor,
                    f"{NOISE_MULTIPLE:g}x the fusion floor {floor:.3g} (eager with every operation of the compiled"
                    " graphs moved by what a compiler may change in it: reference/fusion.py)",
                )
        base = {"step": step, "phase": "compiler", "name": f"{phase}.{name}", "comparator": COMPARATOR}
        finding = Comparator._finding(base, dev.normwise <= tol.limit, dev, tol)
        if not finding.ok:
            finding.message = _blame(phase)
            failures.append(finding)
        elif worst is None or finding.ratio > worst.ratio:
            worst = finding
    if failures:
        return failures
    if worst is None:
        return []
    message = (
        f"the compiled reference within the fusion bound of eager in every record, the worst {worst.ratio:.3g}x"
        f" its tolerance ({worst.name} at step {worst.step}, {worst.mode})"
    )
    return [Finding(0, "compiler", "<compiler>", True, "check", COMPARATOR, message)]


# The clip's total norm is computed outside every compiled graph, by the same eager code in both
# runs (the trainer's clip), from the step's reduced gradients: a compiler changes nothing in it
# but its inputs, which are judged themselves (phase grads). The norm is 1-Lipschitz in them,
# | ||a|| - ||b|| | <= ||a - b||, so it may part from eager by the compiled gradients' own distance
# from eager's, plus each run's rounding of the norm (each evaluation within half of
# perturbation.norm_rounding of the exact norm) and, under a loss scale, of the unscaling (one
# rounding of each element and one of 1/scale: 2 u of the norm, each run). Not the fusion floor:
# a scalar carries one sample of the floor run's random signs, and its gradients' moves may cancel
# there (sweep seed 20271402 with Inductor, case 1338b4b288ba: the floor run's squared sums moved by
# +0.0069, -0.0045 and -0.0022 in three parameters and -0.0001 in all, a floor of 1.1e-5 where nine
# other fusion seeds gave 1.1e-4 to 6.5e-3; the compiled norm 5.1e-4 from eager, every compiled
# gradient closer to eager than the floor run's, and 0.24 of this bound).
def norm_tolerance(case: Case, step: int, eager: Trace, compiled: Trace) -> Tolerance | None:
    """The derived tolerance of the clip's total norm at `step` (above), or None where a gradient
    of the step is not comparable (missing, another shape, not finite: judged as such)."""
    from fsdp_verify.reference.perturbation import norm_rounding

    key = (step, "grad_norm", "total_norm")
    names = _grad_names(eager, step)
    if key not in compiled.records or set(names) != set(_grad_names(compiled, step)):
        return None
    distance, numel = 0.0, 0
    scales = [_scale(trace, step) for trace in (eager, compiled)]
    for name in names:
        ref, got = eager.records[(step, "grads", name)].double(), compiled.records[(step, "grads", name)].double()
        if ref.shape != got.shape or not (ref.isfinite().all() and got.isfinite().all()):
            return None
        distance += float(((got / scales[1] - ref / scales[0]) ** 2).sum())
        numel += ref.numel()
    norms = [abs(float(trace.records[key])) for trace in (eager, compiled)]
    dtype = eager.records[key].dtype
    rounding = norm_rounding(numel, len(names) * case.dp_size, dtype)
    if scales != [1.0, 1.0]:
        rounding += 4 * unit_roundoff(dtype)
    limit = (math.sqrt(distance) + rounding * max(norms)) / max(norms[0], torch.finfo(torch.float64).tiny)
    floor = bound_tolerance(dtype)
    if limit <= floor.limit:
        return floor
    return Tolerance(
        "bound",
        limit,
        f"the compiled gradients' distance from eager's {math.sqrt(distance):.3g} (the norm is computed outside the"
        f" compiled graphs, 1-Lipschitz in its gradients) and each run's rounding of it, {rounding:.3g} of itself",
    )


# The loss, like the clip's norm, is computed outside every compiled graph: the reference trainer
# calls the model (compiled under "units" and "model" alike: `module.compile` compiles its forward,
# which returns the logits) and then the loss (verify/training/loss.py `microbatch_loss`), by the
# same eager code in both runs, in fp32 from the logits as recorded (bf16 logits widen exactly).
# So a compiler changes nothing in it but the logits, which are judged themselves (phase logits),
# and it may part from eager by what the loss's gradient along the segment from eager's logits z_e
# to the compiled z_c allows (the mean value theorem: |L(z_c) - L(z_e)| <= max ||grad L|| ||dz||),
# plus each run's rounding of the loss, with no multiple. Not the fusion floor: one number carries
# one sample of the floor run's random signs, whose moves across the logits may cancel in it
# (case 7d8e5e03e62a: an MLP, world size 1, bf16, `units`, checkpointed; the loss 3.27x 10 times its
# floor of 2.92e-5 at step 2 while the logits were within theirs). The loss record is unscaled
# (a loss scale multiplies what is backpropagated, not what is recorded): no unscaling to add.
#   * An MLP's mean squared error over the step's N output elements (each micro-batch of each rank
#     holds as many samples, Case validation, so the micro-batch means averaged are the mean):
#     L(z) = ||z - t||^2 / N, and L(z_c) - L(z_e) = <dz, dz + 2 (z_e - t)> / N, so
#     |dL| <= ||dz|| (||dz|| + 2 ||z_e - t||) / N. Each run: z - t and its square round each term
#     by 3 u relatively, a sum of n <= N non-negative terms in any order by (n - 1) u, the mean's
#     division, the micro-batches' division and their M additions, the R ranks' additions and
#     their division one u each: (N + M + R + 5) u of the loss.
#   * Cross-entropy, the mean over the T real target tokens (not IGNORE_INDEX) of
#     -log softmax(z_i)[t_i]: row i's gradient is (softmax(z_i) - e_t) / T, of 2-norm at most
#     sqrt(2) / T ((1 - p_t)^2 + sum_j p_j^2 <= 2 (1 - p_t)^2), everywhere; a padded row's is zero.
#     So ||grad L|| <= sqrt(2 / T) and |dL| <= sqrt(2 / T) ||dz|| (dz over every row: an upper
#     bound). Each run: a log-softmax over V classes within (2 (V - 1) + 4) u (1 + |y|) (the bound of
#     two evaluations apart, reference/fusion.py, taken whole for one), the sum of T non-negative
#     terms (T - 1) u, the scale's product, the M micro-batches' and R ranks' additions and the
#     division one u each: ((2 V + 2) (1 + L) + (T + M + R + 2) L) u.
# A user's loss (`--loss`) is a function the toolkit cannot bound: it keeps the fusion floor.
def loss_tolerance(case: Case, step: int, eager: Trace, compiled: Trace) -> Tolerance | None:
    """The derived tolerance of the built-in loss at `step` (above), or None where it cannot be
    derived: a user's loss, or logits that are not comparable (missing, another shape, not
    finite: judged as such), or targets that are not the logits' rows."""
    from fsdp_verify.training.data import global_batch, item_count

    key, logits = (step, "loss", "loss"), (step, "logits", "logits")
    if case.loss is not None or key not in compiled.records or logits not in compiled.records:
        return None
    ref, got = eager.records[logits].double(), compiled.records[logits].double()
    if ref.shape != got.shape or not (ref.isfinite().all() and got.isfinite().all()):
        return None
    targets = global_batch(case, step)[1]
    dz = float((got - ref).norm())
    loss, largest = abs(float(eager.records[key])), max(abs(float(t.records[key])) for t in (eager, compiled))
    u = unit_roundoff(torch.float32)
    ranks, micro = case.dp_size, case.microbatches
    if case.model.kind == "mlp":
        if targets.shape != ref.shape:
            return None
        n = ref.numel()
        moved = dz * (dz + 2 * float((ref - targets.double()).norm())) / n
        rounding = (n + micro + ranks + 5) * u * largest
        how = f"its gradient along the way, 2 ||z - t|| / N over N = {n} outputs"
    else:
        tokens, vocab = item_count(case, targets), ref.shape[-1]
        if targets.numel() * vocab != ref.numel():
            return None
        moved = math.sqrt(2 / max(tokens, 1)) * dz
        rounding = ((2 * vocab + 2) * (1 + largest) + (tokens + micro + ranks + 2) * largest) * u
        how = f"cross-entropy's gradient, sqrt(2 / T) over T = {tokens} tokens"
    limit = (moved + 2 * rounding) / max(loss, torch.finfo(torch.float64).tiny)
    floor = bound_tolerance(eager.records[key].dtype)
    if limit <= floor.limit:
        return floor
    return Tolerance(
        "bound",
        limit,
        f"the compiled logits' distance from eager's {dz:.3g} times {how} (the loss is computed outside the"
        f" compiled graphs, from the logits) and each run's rounding of it, {2 * rounding:.3g}",
    )


def _grad_names(trace: Trace, step: int) -> list[str]:
    return [name for s, phase, name in trace.records if s == step and phase == "grads"]


def _scale(trace: Trace, step: int) -> float:
    """The loss scale the step's gradients were reduced at (1 without one): the clip unscales first."""
    scale = trace.records.get((step, "loss_scale", "scale"))
    return 1.0 if scale is None else float(scale.reshape(-1)[0])


def _blame(phase: str) -> str:
    return (
        f"the reference compiled as the case compiles it parts from the same reference run eagerly, in its {phase}:"
        " the compiler's, not the sharding's (the compiled reference runs on one process)"
    )


def _failure(key, kind: str, what: str) -> Finding:
    step, phase, name = key
    return Finding(step, "compiler", f"{phase}.{name}", False, kind, COMPARATOR, f"{_blame(phase)}: {what}")
