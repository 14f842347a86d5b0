"""The compiler, checked on its own: the reference compiled as the case compiles it against the
same reference run eagerly. The sharded run is compared with the compiled reference, so that a
divergence there is the sharding's; a compiler bug that does not depend on sharding shows in both
compiled runs alike and would pass that comparison. Here it is reported, and named as the
compiler's.

The tolerance is derived from what a compiler may change in a graph (reference/fusion.py): the
eager run again with every operation of the compiled modules moved by that bound, with random
signs, gives the floor of each step and phase; a record may part from eager by NOISE_MULTIPLE
times it (the moves reach every record through later roundings, a sample: as the reduction floor,
verify/compare/tolerance.py), and never by less than the fp32 bound. Dropout under Inductor is not
comparable: Inductor draws its own random numbers, not eager's masks (both compiled runs draw the
same, so the sharded comparison stands).
"""

from __future__ import annotations

from fsdp_verify.case import Case
from fsdp_verify.compare.comparators import Comparator, CompareContext, _finite_parts, _same_nonfinite
from fsdp_verify.compare.finding import Finding
from fsdp_verify.compare.tolerance import NOISE_MULTIPLE, Tolerance, bound_tolerance, measure
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
        if dev.normwise > tol.limit:
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


def _blame(phase: str) -> str:
    return (
        f"the reference compiled as the case compiles it parts from the same reference run eagerly, in its {phase}:"
        " the compiler's, not the sharding's (the compiled reference runs on one process)"
    )


def _failure(key, kind: str, what: str) -> Finding:
    step, phase, name = key
    return Finding(step, "compiler", f"{phase}.{name}", False, kind, COMPARATOR, f"{_blame(phase)}: {what}")
