"""The state right after a resume's load, against the state the run before it ended with (what
its checkpoint saved, at its end): `Recorder(resumed_from=...)` records the first right after
the load, `Recorder.close()` the second (recorder.py `_state`). A load is a copy: every
parameter's and optimizer state's row fingerprints (float64 sums of the same values, only
their order may differ) and every param-group hyperparameter and schedule position are held
exactly, at the step the run saved after, before the first step after it can hide or mix the
loss in its own rounding."""

from __future__ import annotations

import math

from fsdp_verify.compare.finding import Finding
from fsdp_verify.recorder import rules
from fsdp_verify.recorder.align import Rows, deviation, load_step, reassemble
from fsdp_verify.recorder.store import Run

COMPARATOR = "LoadedState"
AT_LOAD, AT_CLOSE = "at_load", "at_close"


def check(run: Run, label: str = "") -> tuple[list[Finding], str | None]:
    """Findings at step `run.resumed_after` for the resumed `run` (none for a run that did not
    resume), and a note where the state was not recorded (a recorder before it did)."""
    if run.before is None:
        return [], None
    step = run.resumed_after
    saved, loaded = run.before.load_state(AT_CLOSE), run.load_state(AT_LOAD)
    if saved is None or loaded is None:
        which = (
            f"{run.before.path} recorded no state at close()" if saved is None else f"{run.path} no state at its load"
        )
        note = f"the load of {run.path} was not compared ({which}: recorded by an older recorder)"
        return [], f"{note}; what it lost shows from step {step + 1} on"
    suffix = f" (after {label}'s load)" if label else " (after the load)"
    before, after = _kinds(saved, AT_CLOSE), _kinds(loaded, AT_LOAD)
    initial = load_step(run, 0, 0).groups.get((0, "params"), {}) if run.calls[0][:1] == [0] else {}
    findings = []
    for kind in sorted(before.keys() | after.keys(), key=lambda k: (k != "params", k)):
        phase = "params" if kind == "params" else "optim_state"
        tag = "" if kind == "params" else f" [{kind.removeprefix('optim.')}]"
        a, b = before.get(kind, {}), after.get(kind, {})
        for name in sorted(a.keys() | b.keys()):
            base = dict(step=step, phase=phase, name=f"{name}{tag}{suffix}", comparator=COMPARATOR)
            if name not in b:
                findings.append(Finding(ok=False, kind="missing", message=_missing(kind, after), **base))
            elif name not in a:
                message = "held right after the load, though the run before ended without it"
                findings.append(Finding(ok=False, kind="unexpected", message=message, **base))
            else:
                findings.append(_rows(base, a[name], b[name], initial.get(name) if kind == "params" else None))
    findings += _hyperparameters(step, saved[0][1], loaded[0][1], suffix)
    return findings, None


def _kinds(state: list[tuple[dict, dict]], when: str) -> dict[str, dict[str, Rows]]:
    tensors, headers = [t for t, _ in state], [h for _, h in state]
    kinds = sorted({key.split("/", 1)[1] for h in headers for key in h if key.startswith(f"{when}/")})
    return {kind: reassemble(tensors, headers, f"{when}/{kind}") for kind in kinds}


def _missing(kind: str, after: dict) -> str:
    if kind == "params":
        return "not held right after the load"
    if not any(k.startswith("optim.") for k in after):
        return (
            "the optimizer holds no state right after the load, as a fresh optimizer before its first step;"
            " the run before ended with state for this parameter: the optimizer's state was never loaded"
        )
    return f"the optimizer holds no {kind.removeprefix('optim.')} for it right after the load (it holds other state)"


def _rows(base: dict, saved: Rows, loaded: Rows, initial: Rows | None) -> Finding:
    if tuple(saved.sum.shape) != tuple(loaded.sum.shape):
        message = f"{tuple(loaded.sum.shape)[0]} rows right after the load, {tuple(saved.sum.shape)[0]} saved"
        return Finding(ok=False, kind="shape", message=message, **base)
    tol = rules.exact_fp64(saved.row_len)
    dev = deviation(saved, loaded)
    message = f"sum {loaded.total:.10g} vs {saved.total:.10g} saved"
    if dev > tol.limit and initial is not None and deviation(initial, loaded) <= tol.limit:
        message += "; the loaded values are its initial ones (its key not loaded)"
    why = "a load is a copy of what the run before saved: " + tol.why
    return Finding(
        ok=dev <= tol.limit,
        kind="deviation",
        normwise=dev,
        tolerance=tol.limit,
        mode="exact",
        why=why,
        message=message,
        **base,
    )


def _hyperparameters(step: int, saved: dict, loaded: dict, suffix: str) -> list[Finding]:
    """The param groups' hyperparameters and the schedule's position, exactly."""
    a, b = saved.get("hyperparameters", {}), loaded.get("hyperparameters", {})
    out = []
    for key in sorted(a.keys() | b.keys()):
        base = dict(step=step, phase="optim_state", name=f"{key}{suffix}", comparator=COMPARATOR)
        if key not in a or key not in b:
            side = "right after the load" if key not in b else "by the run before"
            out.append(Finding(ok=False, kind="missing", message=f"not recorded {side}", **base))
            continue
        x, y = _flat(a[key]), _flat(b[key])
        same = len(x) == len(y) and all(u == v or (math.isnan(u) and math.isnan(v)) for u, v in zip(x, y))
        dev = 0.0 if same else max((abs(u - v) / abs(u) if u else math.inf for u, v in zip(x, y)), default=math.inf)
        out.append(
            Finding(
                ok=same,
                kind="deviation",
                normwise=dev,
                tolerance=0.0,
                mode="exact",
                why="a load is a copy of the saved param groups and schedule",
                message=f"{b[key]} right after the load, {a[key]} saved",
                **base,
            )
        )
    return out


def _flat(value) -> list[float]:
    if isinstance(value, list):
        return [x for v in value for x in _flat(v)]
    return [float(value)]
