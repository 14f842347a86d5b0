"""Compile check: what torch.compile did on the ranks (the compile probe, verify/probes/compile.py),
in the verdict: frames compiled, graph breaks and where, and recompilations. A frame compiled again
in two steps after the run's first (but at the step the case unfreezes parameters, which fail a
guard once) is a finding: a guard that fails every step, and so a compile every step; so is a
frame Dynamo gave up on after its recompile limit because a value changed each call (a limit
reached by variants of one function, its units, shapes and requires_grad patterns, is a note:
`limit_findings`). Once is not:
Dynamo compiles some frames first at the second step (a frame it ran eagerly inside the first
step's resume function), and says so in the summary."""

from __future__ import annotations

import re

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
        if "limits" in record:
            for found in limit_findings(rank, record):
                # A note said on several ranks alike is said once: the ranks run one program
                alike = next((f for f in findings if f.kind == "note" and f.step == found.step), None)
                if found.kind == "note" and alike is not None:
                    alike.message = re.sub(r"^ranks? ([\d, ]+):", rf"ranks \1, {rank}:", alike.message)
                    continue
                findings.append(found)
            continue
        for step, reasons in sorted(record["breaks"].items(), key=lambda kv: int(kv[0])):
            for reason in reasons:
                if LIMIT in reason:  # a record of before the probe kept `limits`: not told apart
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


# Dynamo keeps at most `recompile_limit` graphs per code object (8, torch 2.13); asked for one
# more, it compiles nothing and runs the frame's graphs where their guards pass and the rest
# eagerly (RUN_ONLY). Two ways to get there, told apart by the guard each compile failed against
# the frame's previous graph (Dynamo's `recompile_reason`):
#   * variants: each compile for a guard on what makes a call another call of the same function,
#     the frame's tensors' metadata (a shape, dtype, stride, device, requires_grad), its argument
#     count, its module's type or its forward's code: each unit of a class, each input shape, each
#     requires_grad pattern (frozen parameters, and once more each at `unfreeze_step`) its own
#     graph. A correct program compiled so meets the limit too: it is about the program's speed
#     (the variants past it run eagerly), not a divergence; a note, with the reasons. Issue 48:
#     the toolkit's checkpointing had put every unit of every class under one function and reached
#     it at step 2 on the ranks and on the single-device reference alike; one function per class
#     since (verify/training/checkpointing.py), but a model of more than 8 blocks of distinct shapes
#     (`dynamic=False`) reaches it with no checkpointing at all (tests/test_compile.py).
#   * a value: a compile for any other guard (a Python int the forward reads, `calls == 6`; an
#     object's identity), the same call compiled again because something the program changes
#     each call: a finding, as a frame compiled again every step is (the zoo's
#     `recompiles_every_step` gets there within a step when it calls a frame more than 8 times).
_VARIANT_GUARDS = {
    "size mismatch": "a shape",
    "stride mismatch": "a stride",
    "dtype mismatch": "a dtype",
    "device mismatch": "a device",
    "requires_grad mismatch": "requires_grad",
    "dispatch key set mismatch": "a dispatch key set",
    "len(args)": "the argument count",  # not any len(): a list the program grows is a value
    "len(kwargs)": "the argument count",
    "___check_type_id(": "a module's type",
    "__code__": "a forward's code",
}


def variant_guard(reason: str | None) -> str | None:
    """What Dynamo's `reason` for compiling a frame again says the call differs in, where that is
    something that makes it another variant of the function (above); else None."""
    if not reason:
        return None
    first = reason.splitlines()[0]
    guard = first.split(":", 1)[1] if first[:1].isdigit() and ":" in first else first
    guard = guard.split("#", 1)[0].replace("L['args']", "args").replace("L['kwargs']", "kwargs")  # the comment: source
    if guard.strip().startswith("tensor "):
        return next((what for key, what in _VARIANT_GUARDS.items() if key in guard and "mismatch" in key), None)
    if guard.strip().startswith("___check_obj_id(") and "__code__" not in guard:
        return None  # an object's identity: the same call, another object
    return next((what for key, what in _VARIANT_GUARDS.items() if key in guard and "mismatch" not in key), None)


def limit_findings(rank: int, record: dict) -> list[Finding]:
    """The compiles Dynamo refused at its recompile limit on `rank` (the probe's `limits`), one per
    step: a note where every compile of the frames at the limit was for another variant, else a
    finding (above)."""
    if not record["limits"]:
        return []
    limit = record.get("recompile_limit")
    counts: dict[tuple[str, str], list[str | None]] = {}
    for _step, name, where, _ops, reason in record["frames"]:
        counts.setdefault((name, where), []).append(reason)
    full = {key: reasons for key, reasons in counts.items() if limit is not None and len(reasons) >= limit}
    names = ", ".join(f"{name} ({where})" for name, where in full) or "a frame"
    found: list[Finding] = []
    for step in sorted({int(s) for s, _ in record["limits"]}):
        refused = [reason for s, reason in record["limits"] if int(s) == step]
        reasons = [r for rs in full.values() for r in rs if r] + [r for r in refused if r]
        values = [r for r in reasons if variant_guard(r) is None]
        said = f"Dynamo's recompile limit ({limit} graphs a function, torch._dynamo.config.recompile_limit)"
        if reasons and not values and full:
            kinds = sorted({variant_guard(r) for r in reasons})
            message = (
                f"rank {rank}: {said} reached at step {step} by {names}: {sum(len(rs) for rs in full.values())}"
                f" graphs compiled, {len(refused)} more refused, each for a guard of its own ({', '.join(kinds)}; the last:"
                f" {_short(reasons[-1])}), none a value the program changes: a correct program compiled so meets it"
                " too; the variants past it run eagerly (slower, not wrong; every number judged as usual); raise"
                " recompile_limit to compile them all"
            )
            found.append(Finding(step, "compile", "<recompile limit>", True, "note", COMPARATOR, message))
            continue
        why = f" for {_short(values[-1])}" if values else ""
        message = (
            f"rank {rank}: {said} reached at step {step} by {names}, compiled again{why}: a value the program"
            " changes between calls, so the frame compiled again and again until Dynamo gave up on it; its new"
            " calls run eagerly from then on"
        )
        found.append(Finding(step, "compile", "<recompile limit>", False, "recompiled", COMPARATOR, message))
    return found


def _short(reason: str) -> str:
    """Dynamo's recompile reason without its entry number and source comment: `s.calls == 6`."""
    first = reason.splitlines()[0]
    guard = first.split(":", 1)[1] if first[:1].isdigit() and ":" in first else first
    return guard.split("#", 1)[0].split(". Guard failed", 1)[0].strip()


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
