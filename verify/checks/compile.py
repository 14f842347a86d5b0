"""Compile check: what torch.compile did on the ranks (the compile probe, verify/probes/compile.py),
in the verdict: frames compiled, graph breaks and where, and recompilations. A frame compiled again
in two steps after the run's first (but at the step the case unfreezes parameters, which fail a
guard once) is a finding: a guard that fails every step, and so a compile every step; so is a
frame Dynamo gave up on after its recompile limit (it runs eagerly from then on). Once is not:
Dynamo compiles some frames first at the second step (a frame it ran eagerly inside the first
step's resume function), and says so in the summary."""

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
        for (name, where), steps in late_compiles(case, record).items():
            if len(steps) < 2:
                continue  # once after the first step: Dynamo's own (a frame it first reached then), said in the summary
            reasons = [reason for step, reason in steps if reason]
            why = f" ({reasons[-1]})" if reasons else ""
            findings.append(
                Finding(
                    steps[1][0],
                    "compile",
                    f"<recompiled> {name}",
                    False,
                    "recompiled",
                    COMPARATOR,
                    f"rank {rank} compiled {name} ({where}) again at steps {', '.join(str(s) for s, _ in steps)}"
                    f"{why}: a guard that fails every step compiles every step",
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


def late_compiles(case: Case, record: dict) -> dict[tuple[str, str], list[tuple[int, str | None]]]:
    """Per frame (name, where), the steps after the run's first one at which it was compiled (with
    Dynamo's reason), but the step at which the case unfreezes parameters (which fail a guard once).
    A frame compiled in two such steps is compiled every step; in one, Dynamo first reached it then
    (a frame it ran eagerly in the first step's resume function, measured: once, never again)."""
    first = record["first_step"]
    late: dict[tuple[str, str], list[tuple[int, str | None]]] = {}
    for step, name, where, _ops, reason in record["frames"]:
        if first is not None and step > first and step != case.unfreeze_step:
            steps = late.setdefault((name, where), [])
            if step not in [s for s, _ in steps]:
                steps.append((step, reason))
    return late


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
    once = [f"{name} at step {late[0][0]}" for (name, _), late in late_compiles(case, record).items()]
    again = f"; compiled again once: {', '.join(once)}" if once else ""
    return (
        f"rank 0 compiled {case.compile} ({case.compile_backend}): {steps or 'nothing'}{tail}{again};"
        " no frame compiled every step"
    )
