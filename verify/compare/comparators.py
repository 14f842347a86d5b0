"""Comparators: one per kind of record, each returning Findings with the measured deviation, the
tolerance it was held to and why. See `verify/compare/tolerance.py` for how tolerances are derived."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fsdp_verify.compare.finding import Finding
from fsdp_verify.compare.tolerance import (
    EXACT,
    EXACT_MATCH,
    MARGIN,
    Deviation,
    Tolerance,
    bound_tolerance,
    calibrated_tolerance,
    measure,
    unit_roundoff,
)
from fsdp_verify.trace import PHASES, Key, Trace, sort_key

Calibration = Callable[[], list[Trace]]


class Comparator:
    """Compares the records of one phase. Subclasses choose the tolerance."""

    phase: str = ""
    calibratable = True  # may fall back to a calibrated tolerance when the bound is exceeded

    def tolerance(self, key: Key, ref: torch.Tensor, ctx: CompareContext) -> Tolerance:
        return bound_tolerance(ref.dtype)

    def compare(self, key: Key, ref: torch.Tensor, got: torch.Tensor, ctx: CompareContext) -> Finding:
        step, phase, name = key
        base = dict(step=step, phase=phase, name=name, comparator=type(self).__name__)
        if tuple(ref.shape) != tuple(got.shape):
            return Finding(
                ok=False, kind="shape", message=f"shape {tuple(got.shape)}, expected {tuple(ref.shape)}", **base
            )
        if ref.dtype == got.dtype and torch.equal(ref, got):  # the common case: nothing to measure
            return self._finding(base, True, EXACT_MATCH, self.tolerance(key, ref, ctx))
        ref_finite = not ref.is_floating_point() or bool(torch.isfinite(ref).all())
        got_finite = not got.is_floating_point() or bool(torch.isfinite(got).all())
        if not (ref_finite and got_finite):
            # An fp16 step whose scaled gradients overflowed (skipped by the loss scaler): the
            # reference adds in the engine's order, so its infs and NaNs are where the engine's
            # are, with the same signs. Where a partial sum overflows, though, the order decides
            # between inf and NaN (60000 + 60000 - 60000 - 60000 in fp16 is inf or NaN by the
            # grouping) or whether a value overflows at all; a world-size-4 reduce-scatter whose
            # order the emulation does not pin gave NaN against the engine's inf at one element
            # (sweep seed 20261225, regression 1f67271198c5). So an element may also be what a
            # numerically equivalent run made it (`CompareContext.nonfinite_allowed`); the
            # elements finite on both sides are measured as always.
            if not _same_nonfinite(ref, got) and not ctx.nonfinite_allowed(key, got):
                message = (
                    "non-finite values where the reference is finite"
                    if ref_finite
                    else "infs or NaNs other than the reference's (positions or signs)"
                )
                return Finding(ok=False, kind="nonfinite", message=message, **base)
            ref, got = _finite_parts(ref, got)
        dev = measure(ref, got)
        tol = self.tolerance(key, ref, ctx)
        if dev.normwise > MARGIN * tol.limit and self.calibratable and ctx.calibrate is not None:
            # Near or past the bound: judge against what the arithmetic allows (never less than
            # the bound), so a pass says how far it is from failing, and a fail is a real one.
            tol = calibrated_tolerance(ref.dtype, ctx.noise(key), *ctx.floor(key))
        ok = dev.normwise <= tol.limit
        return self._finding(base, ok, dev, tol)

    @staticmethod
    def _finding(base: dict, ok: bool, dev: Deviation, tol: Tolerance) -> Finding:
        return Finding(
            ok=ok,
            kind="deviation",
            max_abs=dev.max_abs,
            normwise=dev.normwise,
            max_rel=dev.max_rel,
            max_ulp=dev.max_ulp,
            tolerance=tol.limit,
            mode=tol.mode,
            why=tol.why,
            **base,
        )


class InitParamsComparator(Comparator):
    """Initial parameters after sharding, gathered: bit-identical (a rank that initialised
    differently, or a shard that holds the wrong slice, shows here)."""

    phase = "init"

    calibratable = False

    def tolerance(self, key, ref, ctx):
        return EXACT


class BuffersComparator(Comparator):
    """Buffers (RoPE frequencies, norm statistics) on rank 0, at step 0 and after each step:
    bit-identical, as both sides compute them by the same code from the same inputs."""

    phase = "buffers"

    calibratable = False

    def tolerance(self, key, ref, ctx):
        return EXACT


class LogitsComparator(Comparator):
    phase = "logits"


class LossComparator(Comparator):
    phase = "loss"


class GradsComparator(Comparator):
    """Full gradients after reduction, before clipping."""

    phase = "grads"


class GradNormComparator(Comparator):
    """The total norm clipping returned: must be the global one (seed 001: 14.283, not 10.63)."""

    phase = "grad_norm"


class LossScaleComparator(Comparator):
    """Each rank's loss scale at a step and whether it skipped the step (fp16 dynamic loss
    scaling): decisions, so exact. The reference decides once for all ranks (any overflow skips
    the step everywhere); a rank that decided alone differs here, named by its index."""

    phase = "loss_scale"

    calibratable = False

    def tolerance(self, key, ref, ctx):
        return EXACT

    def compare(self, key, ref, got, ctx):
        finding = super().compare(key, ref, got, ctx)
        if not finding.ok and finding.kind == "deviation" and ref.shape == got.shape:
            ranks = [r for r in range(ref.numel()) if ref[r].item() != got[r].item()]
            finding.message = "; ".join(_decision(key[2], r, ref[r].item(), got[r].item()) for r in ranks)
        return finding


def _decision(name: str, rank: int, ref: float, got: float) -> str:
    if name == "skipped":
        if got:
            return f"rank {rank} skipped the step, the reference steps (no inf or NaN in the reduced gradients)"
        return f"rank {rank} stepped, the reference skips the step on every rank (an inf or NaN in some rank's shard)"
    return f"rank {rank} {name} {got:.10g}, the reference {ref:.10g}"


class ModulesComparator(Comparator):
    """A zoom's module outputs (verify/zoom/): held as the logits are."""

    phase = "modules"


class ModuleGradsComparator(Comparator):
    """A zoom's gradients with respect to each module's outputs and inputs, one rank's pass."""

    phase = "module_grads"


class OpsComparator(Comparator):
    """A zoom's operation outputs inside one module."""

    phase = "ops"


class ParamsComparator(Comparator):
    """Parameters after the optimizer step."""

    phase = "params"


class OptimStateComparator(Comparator):
    phase = "optim_state"


class ParamSumsComparator(Comparator):
    """float64 sums from the local shards. A sum of n values may move by the sum of their
    allowed moves: n * (the parameter's tolerance) * max|p|, plus float64 reassociation
    (n * 2**-53 * sum|p|, generous for a pairwise sum). `__total__` sums that over every parameter
    the module exposes, so a parameter held twice doubles it (seed 004, finding 4)."""

    phase = "param_sums"

    calibratable = False

    def compare(self, key, ref, got, ctx):
        step, phase, name = key
        base = dict(step=step, phase=phase, name=name, comparator=type(self).__name__)
        params_phase = "init" if step == 0 else "params"
        names = ctx.names(step, params_phase)
        if name != "__total__":
            names = [name] if name in names else []
        allowed = sum(ctx.sum_allowance((step, params_phase, n)) for n in names)
        # NaN on both sides is the same sum (inf - inf inside it), as the parameters compare exact.
        exact = ref.dtype == got.dtype and (torch.equal(ref, got) or bool(ref.isnan().all() and got.isnan().all()))
        dev = EXACT_MATCH if exact else measure(ref, got)
        scale = abs(ref.item())
        # Relative to the sum when it is not zero, absolute otherwise.
        normwise, limit = (dev.max_abs / scale, allowed / scale) if scale > 0 else (dev.max_abs, allowed)
        dev = Deviation(dev.max_abs, normwise, dev.max_rel, dev.max_ulp, dev.scale)
        tol = Tolerance("bound", limit, "n x the parameters' own tolerance + float64 reassociation")
        # Equal sums pass whatever the allowance: where both sides overflowed (cancellation data
        # at scale 100 through a routed expert), the allowance is inf * 0.
        return self._finding(base, exact or normwise <= limit, dev, tol)


class ResumedComparator(Comparator):
    """The state right after a checkpoint's load (docs/resume.md): parameters, optimizer state
    (Adam's `step` too), lr, every rank's generator, the loss scaler's state and the data
    position, against the run that never stopped. A load is a copy: bit-identical."""

    phase = "resumed"

    calibratable = False

    def tolerance(self, key, ref, ctx):
        return EXACT


COMPARATORS: dict[str, Comparator] = {
    c.phase: c()
    for c in (
        InitParamsComparator,
        BuffersComparator,
        ModulesComparator,
        LogitsComparator,
        LossComparator,
        ModuleGradsComparator,
        OpsComparator,
        GradsComparator,
        LossScaleComparator,
        GradNormComparator,
        ParamsComparator,
        ParamSumsComparator,
        OptimStateComparator,
        ResumedComparator,
    )
}
assert set(COMPARATORS) <= set(PHASES)


def _finite_parts(ref: torch.Tensor, got: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two with every element that is non-finite in either set to 0 (as they are)."""
    if not ref.is_floating_point():
        return ref, got
    got = got.to(ref.dtype)
    finite = torch.isfinite(ref) & torch.isfinite(got)
    if bool(finite.all()):
        return ref, got
    return ref.where(finite, 0), got.where(finite, 0)


def _nonfinite_class(t: torch.Tensor) -> torch.Tensor:
    """Per element: 0 finite, 1 +inf, 2 -inf, 3 NaN."""
    t = t.float()
    return torch.where(torch.isnan(t), 3, torch.where(t == float("inf"), 1, torch.where(t == float("-inf"), 2, 0)))


def _same_nonfinite(ref: torch.Tensor, got: torch.Tensor) -> bool:
    """Infs and NaNs at the same positions, infs of the same sign."""
    got = got.to(ref.dtype)
    nan = torch.isnan(ref)
    if not torch.equal(nan, torch.isnan(got)):
        return False
    inf = torch.isinf(ref)
    return torch.equal(inf, torch.isinf(got)) and torch.equal(ref[inf], got[inf])


class CompareContext:
    """What comparators may consult: the reference trace, the limits already decided, and
    (lazily) the calibration noise of each record."""

    def __init__(self, ref: Trace, calibrate: Calibration | None):
        self.ref = ref
        self.calibrate = calibrate
        self._noise: dict[tuple[int, str], float] | None = None
        self._floor: dict[tuple[int, str], float] | None = None
        self._moved: set[str] = set()
        self._names: dict[tuple[int, str], list[str]] | None = None
        self._runs: list[Trace] = []
        self.limits: dict[Key, float] = {}
        self._allowances: dict[Key, float] = {}

    def _calibrate(self) -> None:
        """Deviations of the calibration runs from the reference, pooled per step and phase:
        every record of one phase at one step went through the same perturbations (reassociated
        sums a step earlier, then bf16 rounding flips), so the largest deviation any of them
        showed is a sample of what each may show; one record's own samples are too few (a
        reversed order can happen to round the same way). For the noise the loss is pooled with
        the logits (a function of them). The run marked `perturbed` (reference/perturbation.py)
        gives the floor, with the pools it moved directly listed in its `moved`."""
        self._noise, self._floor, self._moved = {}, {}, set()
        self._runs = list(self.calibrate())
        for other in self._runs:
            perturbed = other.meta.get("perturbed") is not None
            if perturbed:
                self._moved |= set(other.meta.get("moved", []))
            for k, ref in self.ref.records.items():
                if k in other.records and other.records[k].shape == ref.shape:
                    into, pool = (
                        (self._floor, (k[0], k[1]))
                        if perturbed
                        else (self._noise, (k[0], "logits" if k[1] == "loss" else k[1]))
                    )
                    # Elements non-finite in either run are compared by class, not by size
                    # (`nonfinite_allowed`): an inf here would make every record of the pool's
                    # tolerance unbounded.
                    into[pool] = max(into.get(pool, 0.0), measure(*_finite_parts(ref, other.records[k])).normwise)

    def nonfinite_allowed(self, key: Key, got: torch.Tensor) -> bool:
        """Whether every element of `got` is finite, +inf, -inf or NaN as the reference or some
        calibration run has it there (the orders a correct engine may add in). False without
        calibration."""
        if self.calibrate is None:
            return False
        if self._noise is None:
            self._calibrate()
        runs = [self.ref.records[key]] + [r.records[key] for r in self._runs if key in r.records]
        mine = _nonfinite_class(got)
        allowed = torch.zeros_like(mine, dtype=torch.bool)
        for run in runs:
            if run.shape == got.shape:
                allowed |= _nonfinite_class(run) == mine
        return bool(allowed.all())

    def noise(self, key: Key) -> float:
        """The largest deviation of a numerically equivalent run, in this record's pool."""
        if self._noise is None:
            self._calibrate()
        return self._noise.get((key[0], "logits" if key[1] == "loss" else key[1]), 0.0)

    def floor(self, key: Key) -> tuple[float, bool]:
        """The perturbed run's deviation in this record's pool (its step and phase), and whether
        the pool was moved directly (rather than only through what it depends on)."""
        if self._floor is None:
            self._calibrate()
        return self._floor.get((key[0], key[1]), 0.0), self._moved_only_directly(key[0], key[1])

    def _moved_only_directly(self, step: int, phase: str) -> bool:
        """Whether the perturbed run's deviation in this pool is its own direct move alone. A pool
        moved directly whose inputs were moved too (the gradients of a step after moved
        parameters, the clip norm of moved gradients) also carries what it inherited through
        rounding flips and through the random signs of the moves (a sample, not a bound; a user
        step's reference showed both: gradients at step 2 of an fp32 world-size-3 run 3.8x their
        step-2 floor, a bf16 clip norm 2.9x its floor) and takes the noise multiple as
        inherited-only pools do."""
        if f"{step}/{phase}" not in self._moved:
            return False
        first = min(int(m.split("/")[0]) for m in self._moved)
        return step == first and not (phase == "grad_norm" and f"{step}/grads" in self._moved)

    def names(self, step: int, phase: str) -> list[str]:
        """Record names of one step and phase of the reference, indexed once."""
        if self._names is None:
            self._names = {}
            for s, p, n in self.ref.records:
                self._names.setdefault((s, p), []).append(n)
        return self._names.get((step, phase), [])

    def limit_of(self, key: Key) -> float:
        return self.limits.get(key, 0.0)

    def sum_allowance(self, key: Key) -> float:
        """How far the float64 sum of the reference's parameter record `key` may move: its
        numel x its own tolerance x max|p|, plus float64 reassociation (numel x 2**-53 x
        sum|p|). Computed once a record: `__total__` adds every parameter's again."""
        if key not in self._allowances:
            # |p| in the record's own dtype (its max is exact there), summed in float64 without
            # a float64 copy of the record first: a bound, a third of the passes.
            p = self.ref.records[key].abs()
            moves = self.limit_of(key) * p.max().item()
            reassociation = p.numel() * unit_roundoff(torch.float64) * torch.sum(p, dtype=torch.float64).item()
            self._allowances[key] = p.numel() * moves + reassociation
        return self._allowances[key]


def compare_traces(ref: Trace, got: Trace, calibrate: Calibration | None = None) -> list[Finding]:
    """Every record of the reference against the sharded one, in execution order, plus records
    the sharded side has and the reference does not."""
    ctx = CompareContext(ref, calibrate)
    findings: list[Finding] = []
    for key in ref.keys_sorted():
        step, phase, name = key
        comparator = COMPARATORS.get(phase)
        if comparator is None:
            continue  # a record only a check reads
        if key not in got.records:
            findings.append(
                Finding(
                    step, phase, name, False, "missing", type(comparator).__name__, "the sharded run has no such record"
                )
            )
            continue
        finding = comparator.compare(key, ref.records[key], got.records[key], ctx)
        ctx.limits[key] = finding.tolerance
        findings.append(finding)
    for key in sorted(set(got.records) - set(ref.records), key=sort_key):
        step, phase, name = key
        findings.append(
            Finding(
                step,
                phase,
                name,
                False,
                "unexpected",
                type(COMPARATORS[phase]).__name__,
                "the reference has no such record",
            )
        )
    return findings
