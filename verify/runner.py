"""Run one Case on both sides and judge it: the reference in this process while the pool's ranks
run the sharded side, then the comparators, then the verdict."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from fsdp_verify.case import Case
from fsdp_verify.case_rules import for_the_resumed_run
from fsdp_verify.checks import run_checks
from fsdp_verify.checks.compiler import check_compiler, compiler_hint
from fsdp_verify.compare.comparators import compare_traces
from fsdp_verify.compare.finding import Finding
from fsdp_verify.dims import registry
from fsdp_verify.engines import engine_arithmetic, engine_capabilities, refuse_untakeable
from fsdp_verify.engines.tensor_parallel import reduce_dtype_hint
from fsdp_verify.hints import hint
from fsdp_verify.reference import train_reference, train_reference_step
from fsdp_verify.reference.records import RankShare
from fsdp_verify.sharded.pool import RankFailure, RankPool, get_pool
from fsdp_verify.sharded.resume import as_saved, merged, run_resumed, steps_of
from fsdp_verify.trace import Trace
from fsdp_verify.training.compile import compiling
from fsdp_verify.training.threads import rank_like_threads
from fsdp_verify.validation import CaseError
from fsdp_verify.verdict import Verdict


def emulating_reference(case: Case, share: RankShare | None = None) -> Trace:
    """The reference run that emulates the engine under test: FSDP2's arithmetic unless the
    engine declares its own (verify/engines/arithmetic.py); with a user's step, that step on the
    global batch (reference/user_step.py). `share`: the emulated ranks split over processes
    (verify/sharded/shared_reference.py; not with a user's step)."""
    if case.step is not None:
        return train_reference_step(case, arithmetic=engine_arithmetic(case.engine))
    return train_reference(case, arithmetic=engine_arithmetic(case.engine), share=share)


def calibration_runs(case: Case) -> list[Trace]:
    """Numerically equivalent reference runs: the ranks' gradients summed in rank order, in
    reverse order (with a clip's norm from the full gradients, summed in reverse), and in ring
    order along each unit's flattened gradient (a FlatParameter engine's reduce-scatter
    segments); and the emulation without FSDP2's identity node on unit inputs (FSDP1 and most
    home-grown engines have none; autograd then adds the residual stream's gradient
    contributions in another grouping: measured bit-exact against FSDP1, 16 fp32 ulp away from
    FSDP2 on a tiny tied Transformer). These are the freedoms a correct engine has. The global
    batch in one piece is not: its per-rank bf16 roundings differ from any sharded run's, and
    calibrating on them hid a reduction silently done in bf16.

    Last, the floor: the emulation with every order-dependent result moved by its derived error
    bound (reference/perturbation.py), so that an order none of the runs above samples cannot
    collapse a tolerance below what the arithmetic allows."""
    arithmetic = engine_arithmetic(case.engine)
    if case.step is not None:  # the same freedoms around a user's step, and its own loss scale
        with rank_like_threads():
            return [
                train_reference_step(case, order="rank", arithmetic=arithmetic),
                train_reference_step(case, order="reverse", arithmetic=arithmetic),
                train_reference_step(case, scale_ulp=True, arithmetic=arithmetic),
                train_reference_step(case, unit_input_node=False, arithmetic=arithmetic),
                train_reference_step(case, perturb=int(case.hash[:8], 16), arithmetic=arithmetic),
            ]
    with rank_like_threads():
        return [
            train_reference(case, order="rank", arithmetic=arithmetic),
            train_reference(case, order="reverse", arithmetic=arithmetic),
            train_reference(case, order="flat", arithmetic=arithmetic),
            train_reference(case, unit_input_node=False, arithmetic=arithmetic),
            train_reference(case, perturb=int(case.hash[:8], 16), arithmetic=arithmetic),
        ]


def own_checks(case: Case, ref: Trace) -> list[Finding]:
    """What the reference checks of itself, apart from the sharding: a compiled case compiled
    against eager (verify/checks/compiler.py), and each dimension package's own check of its
    arithmetic (float8's casts: verify/dims/float8/rounding.py)."""
    return check_compiler(case, ref) + registry.own_checks(case)


def judge(
    case: Case,
    ref: Trace,
    got: Trace,
    calibrate: bool = True,
    checks: Callable[[], list[Finding]] | None = None,
    own: list[Finding] | None = None,
) -> Verdict:
    """`checks`: the checks' findings when they are not `run_checks` on the two traces (a resume
    checks each run on its own: verify/sharded/resume.py). `own`: the reference's own checks
    (`own_checks`), when computed already."""
    calibrated: list[float] = []

    def calibration() -> list[Trace]:
        t = time.perf_counter()
        runs = calibration_runs(case)
        calibrated.append(time.perf_counter() - t)
        return runs

    t = time.perf_counter()
    if got.meta.get("stopped"):
        # The sharded run stopped before its first step (verify/sharded/loop.py): it has no
        # records to compare, and only the checks of what it built judge it.
        findings, t_checks = [], time.perf_counter()
        findings += run_checks(case, ref, got, phases=("build",))
    else:
        findings = compare_traces(ref, got, calibration if calibrate else None)
        t_checks = time.perf_counter()
        findings += checks() if checks is not None else run_checks(case, ref, got)
    findings += own if own is not None else own_checks(case, ref)
    verdict = Verdict(case, findings, calibrated=bool(calibrated))
    verdict.seconds = {
        "compare": t_checks - t - sum(calibrated),
        "calibration": sum(calibrated),
        "checks": time.perf_counter() - t_checks,
    }
    verdict.hint = hint(verdict.first_divergence, ref, got, case.world_size, case.init, case)
    verdict.hint = verdict.hint or compiler_hint(case, verdict.first_divergence)
    verdict.hint = verdict.hint or reduce_dtype_hint(case, verdict.first_divergence)
    if case.loss_scaling is not None:
        verdict.loss_scales = _loss_scales(ref, got)
    return verdict


def _loss_scales(ref: Trace, got: Trace) -> list[dict]:
    """Each step's loss scale and skip decision, the reference's and each rank's (None for a step
    the ranks did not reach: they stop after parting on a skip)."""
    rows = []
    for step in range(1, ref.steps + 1):
        scale, skipped = (step, "loss_scale", "scale"), (step, "loss_scale", "skipped")
        if scale not in ref.records:
            continue
        ranks = None
        if scale in got.records and skipped in got.records:
            ranks = [[s, int(k)] for s, k in zip(got.records[scale].tolist(), got.records[skipped].tolist())]
        rows.append(
            {
                "step": step,
                "scale": ref.records[scale][0].item(),
                "skipped": int(ref.records[skipped][0].item()),
                "ranks": ranks,
            }
        )
    return rows


def check_case(
    case: Case, pool: RankPool | None = None, timeout_s: float | None = None, calibrate: bool = True
) -> Verdict:
    """Raises RankFailure when a rank crashes or hangs (the pool recovers on the next case), and
    CaseError before any rank starts for a case the engine declares it cannot take."""
    if case.resume_after is not None:
        return check_resumed_case(case, pool, timeout_s, calibrate)
    refuse_untakeable(case)
    pool = pool or get_pool(case.world_size)
    t0 = time.perf_counter()
    # A compiled case compiles its reference first: the ranks then load the same graphs from
    # Inductor's cache (verify/training/compile.py) instead of compiling them W + 1 times at once.
    submitted = case.compile is None
    if submitted:
        pool.submit(case)
    # A compiled case's reference compiles fresh, under the Dynamo options the engine declares
    # (verify/training/compile.py), put back after it and the compiler's check.
    compiled = compiling(engine_capabilities(case.engine).dynamo_config) if case.compile else contextlib.nullcontext()
    try:
        with compiled:
            with rank_like_threads():
                ref = emulating_reference(case)  # overlaps with the ranks' work
            t_ref = time.perf_counter()
            if not submitted:
                pool.submit(case)
                submitted = True
            own = own_checks(case, ref)  # and the reference's own checks (the compiler's, a dimension's)
    except CaseError:  # the user's code failed on the reference: bad input, whatever the ranks did
        if submitted:
            with contextlib.suppress(RankFailure):
                pool.result(timeout_s)
        raise
    except BaseException:
        if submitted:
            pool.result(timeout_s)  # keep the pool in step before propagating
        raise
    t1 = time.perf_counter()
    got = pool.result(timeout_s)
    t2 = time.perf_counter()
    verdict = judge(case, ref, got, calibrate, own=own)
    verdict.seconds = {"reference": t_ref - t0, "sharded_wait": t2 - t1, **verdict.seconds}  # compiled: not overlapped
    if case.compile is not None:
        verdict.seconds["compiler_check"] = t1 - t_ref
    return verdict


def check_resumed_case(
    case: Case, pool: RankPool | None = None, timeout_s: float | None = None, calibrate: bool = True
) -> Verdict:
    """`check_case` for a case with a resume: the sharded runs against the reference that never
    stopped; every record compared as usual, the loaded state exactly; the checks (ownership,
    precision, RNG, contracts) run on each run against its own case and steps."""
    before, after = case.before_resume(), case.after_resume()
    refuse_untakeable(before)
    try:
        refuse_untakeable(after)
    except CaseError as e:
        raise for_the_resumed_run(e, case) from None
    t0 = time.perf_counter()

    def reference() -> tuple[Trace, float]:
        with rank_like_threads():
            return emulating_reference(case), time.perf_counter()

    saved, resumed, (ref, t_ref) = run_resumed(case, pool, timeout_s, reference)
    t1 = time.perf_counter()
    k = case.resume_after

    def checks() -> list[Finding]:
        early = run_checks(before, steps_of(ref, lambda s: s <= k), saved)
        late = run_checks(after, steps_of(ref, lambda s: s > k), steps_of(resumed, lambda s: s > k))
        # The resumed run ran from k + 1: steps 1 to k are the first run's, checked above (the
        # contracts expect from the run's first step, `Trace.first_step`; kept as a guard).
        return early + [f for f in late if not 1 <= f.step <= k]

    verdict = judge(case, as_saved(ref, saved, k), merged(saved, resumed), calibrate, checks)
    verdict.seconds = {"reference": t_ref - t0, "sharded_wait": t1 - t_ref, **verdict.seconds}
    return verdict
