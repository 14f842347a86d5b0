"""Compile check: what torch.compile did on the ranks (the compile probe, verify/probes/compile.py),
in the verdict: frames compiled, graph breaks and where, and recompilations. A frame compiled again
after a run's first step is a finding, except at the step the case changes what trains
(`unfreeze_step`: parameters that start to require grad fail a guard once): a step that compiles
again points at a guard that fails every step, and so at a compile every step."""

from __future__ import annotations

from fsdp_verify.case import Case
from fsdp_verify.compare.finding import Finding
from fsdp_verify.trace import Trace

COMPARATOR = "CompileReport"
LIMIT = "recompile limit exceeded"  # Dynamo's graph-break type when it gives up on a frame


def check_compile(case: Case, ref: Trace, got: Trace) -> list[Finding]:
    findings: list[Finding] = []
    for rank, record in enumerate(got.meta.get("compile") or []):
        if not record:
            continue
        first, seen = record["first_step"], set()
        for step, name, where, _ops, reason in record["frames"]:
            late = first is not None and step > first and step != case.unfreeze_step
            if not late or (name, where) in seen:
                continue
            seen.add((name, where))
            why = f": {reason}" if reason else " (a frame first compiled after the run's first step)"
            findings.append(
                Finding(
                    step,
                    "compile",
                    f"<recompiled> {name}",
                    False,
                    "recompiled",
                    COMPARATOR,
                    f"rank {rank} compiled {name} ({where}) again at step {step}{why}; a guard that fails after the"
                    " first step compiles again every step",
                )
            )
        for step, reasons in sorted(record["breaks"].items(), key=lambda kv: int(kv[0])):
            for reason in reasons:
                if LIMIT in reason:  # Dynamo stopped compiling a frame: it runs eagerly from then on
                    findings.append(
                        Finding(
                            int(step),
                            "compile",
                            "<recompile limit>",
                            False,
                            "recompiled",
                            COMPARATOR,
                            f"rank {rank}: {reason} at step {step}: a frame compiled again and again until Dynamo"
                            " gave up on it, and it runs eagerly from then on",
                        )
                    )
    return findings


def compile_summary(case: Case, ref: Trace, got: Trace) -> str | None:
    """Rank 0's compilation: frames and operations per step, graph breaks by reason and how many."""
    ranks = got.meta.get("compile") or []
    if not ranks or not ranks[0]:
        return None
    record = ranks[0]
    by_step: dict[int, list] = {}
    for frame in record["frames"]:
        by_step.setdefault(frame[0], []).append(frame)
    steps = "; ".join(
        f"step {s}: {len(fs)} frames, {sum(f[3] for f in fs)} operations" for s, fs in sorted(by_step.items())
    )
    breaks: dict[str, int] = {}
    for per_step in record["breaks"].values():
        for reason, count in per_step.items():
            breaks[reason] = breaks.get(reason, 0) + count
    said = "; ".join(f"{count}x {reason}" for reason, count in sorted(breaks.items(), key=lambda kv: -kv[1]))
    tail = f"; graph breaks: {said}" if breaks else "; no graph break"
    cache = record.get("cache") or {}
    if cache.get("hit") or cache.get("miss"):
        tail += f"; {cache['hit']} of {cache['hit'] + cache['miss']} graphs from Inductor's cache"
    return (
        f"rank 0 compiled {case.compile} ({case.compile_backend}): {steps or 'nothing'}{tail}; nothing compiled again"
    )
