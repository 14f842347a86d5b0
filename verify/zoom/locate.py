"""Zoom: run a diverging step again on both sides with per-module probes, name the first module
whose forward output parts (or, if the forward agrees, the first module in backward order whose
input gradient parts while its output gradient agrees), then run it once more with an op probe
inside that module and name the first operation whose output parts. Every record is judged by
the comparators and derived tolerances every other record is (bound, then calibration reruns of
the reference recording the same probes): a reordered reduction is not named, and a passing case
names nothing."""

from __future__ import annotations

import difflib
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from fsdp_verify.case import Case
from fsdp_verify.compare.comparators import compare_traces
from fsdp_verify.compare.finding import Finding
from fsdp_verify.compare.tolerance import bound_tolerance, measure
from fsdp_verify.trace import Trace
from fsdp_verify.validation import CaseError
from fsdp_verify.verdict import Verdict
from fsdp_verify.zoom.watch import pass_id


@dataclass
class Zoom:
    """What a zoom named: the chain step -> phase -> module -> op, each with its ratio."""

    case_hash: str
    step: int
    phase: str | None = None  # the verdict's first divergence, when the zoom follows one
    record: str | None = None
    ratio: float | None = None
    direction: str | None = None  # "forward" | "backward": where the module was named
    module: str | None = None  # its FQN ("" the root); None: no module parts
    call: int = 0
    microbatch: int = 0
    rank: int = 0
    place: str = ""  # where that rank's value lies in a composed run: its tp rank, the expert (`place`)
    expert: int | None = None  # the first expert whose rows part, where a grouped experts module is named
    via: str | None = None  # the module whose records part first (the named one encloses it, or is it)
    module_ratio: float | None = None
    why: str = ""  # how the module was named, or why none was
    op: str | None = None
    op_index: int | None = None
    op_ratio: float | None = None
    op_where: str = ""  # "parts" | "only on the sharded side" | "only on the reference"
    op_inputs_agree: bool | None = None
    ops: list[dict[str, Any]] = field(default_factory=list)  # the module's ops, in the parting pass
    modules: list[dict[str, Any]] = field(default_factory=list)  # per module: worst ratios (the tree)
    saved: str | None = None  # the safetensors file with the op's inputs and outputs
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def named(self) -> bool:
        return self.module is not None

    def chain(self) -> str:
        """One line: step -> phase -> module -> op, the ratio of deviation to tolerance at each."""
        parts = [f"step {self.step}"]
        if self.phase is not None:
            parts.append(f"{self.phase} {self.record!r} ({_r(self.ratio)})")
        if self.module is None:
            return " -> ".join(parts) + f" -> no module parts ({self.why})"
        where = f"rank {self.rank}{', ' + self.place if self.place else ''}, micro-batch {self.microbatch}"
        parts.append(f"{self.direction} of module {_fqn(self.module)} ({_r(self.module_ratio)}, {where})")
        if self.op is not None:
            extra = "" if self.op_where == "parts" else f", {self.op_where}"
            parts.append(f"op #{self.op_index} {self.op} ({_r(self.op_ratio)}{extra})")
        elif self.op_where:
            parts.append(self.op_where)
        return " -> ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe (report.schema.json's `zoom`): infinite ratios as "inf"."""
        from fsdp_verify.reports.schema import ratio

        out = dict(self.__dict__)
        for key in ("ratio", "module_ratio", "op_ratio"):
            out[key] = ratio(out[key])
        out["modules"] = [{**m, "forward": ratio(m["forward"]), "backward": ratio(m["backward"])} for m in self.modules]
        out["ops"] = [{**o, "ratio": ratio(o["ratio"])} for o in self.ops]
        out["chain"] = self.chain()
        return out


def _r(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.3g}x"


def _fqn(fqn: str) -> str:
    return repr(fqn) if fqn else "'' (the root)"


# ---- running a zoom pass ------------------------------------------------------------------------
def zoom_case(case: Case, step: int, spec: str) -> Case:
    """`case` run as far as `step` with the zoom's probes `spec`. A resumed case (issue 48): a step
    up to the save is the first run's, which is the case without its resume as far as the step
    (`steps=step` with `resume_after` kept is no case: nothing would be left to resume, and the
    zoom failed on it); a later step is the resumed run's, so the run saves and resumes as the
    case does and the probes watch the resumed run (`_run`, and the reference's resumed run)."""
    if case.resume_after is not None and step <= case.resume_after:
        return case.before_resume().with_(steps=step, zoom=spec)
    return case.with_(steps=step, zoom=spec)


def _run(case: Case, pool, timeout_s: float | None) -> tuple[Trace, Trace]:
    from fsdp_verify.runner import emulating_reference
    from fsdp_verify.sharded.pool import get_pool
    from fsdp_verify.training.threads import rank_like_threads

    if case.resume_after is not None:  # a step after the save (`zoom_case`): the resumed run's
        from fsdp_verify.sharded.resume import run_resumed

        def reference() -> Trace:
            with rank_like_threads():
                return emulating_reference(case)

        _saved, resumed, ref = run_resumed(case, pool, timeout_s, reference)
        return ref, resumed
    pool = pool or get_pool(case.world_size)
    pool.submit(case)
    try:
        with rank_like_threads():
            ref = emulating_reference(case)
    except BaseException:
        pool.result(timeout_s)
        raise
    return ref, pool.result(timeout_s)


def _only(trace: Trace, phases: tuple[str, ...]) -> Trace:
    return Trace(trace.side, {k: v for k, v in trace.records.items() if k[1] in phases}, dict(trace.meta))


def _op_groups(trace: Trace) -> dict[str, list[tuple[str, str]]]:
    """Per pass and call ("MB.rR:cC"): the ops in order, as (record prefix, op name)."""
    groups: dict[str, dict[str, str]] = {}
    for _step, phase, name in trace.records:
        if phase != "ops":
            continue
        group, call, idx, op, _out = name.split(":")
        groups.setdefault(f"{group}:{call}", {})[f"{group}:{call}:{idx}:{op}"] = op
    return {g: sorted(ops.items()) for g, ops in groups.items()}


def align_ops(ref: Trace, other: Trace) -> tuple[Trace, dict[str, list[tuple[str, str]]]]:
    """`other` with its op records renamed to the reference's names where the two sequences of op
    names match (difflib): an engine may run ops the reference does not (an accumulation into
    .grad) without shifting every later op. Returns also the ops of either. Per group, the merged sequence: ("both" | "sharded" | "reference", record prefix), the
    first in the reference's names, the others in their own side's."""
    mine, theirs = _op_groups(ref), _op_groups(other)
    rename: dict[str, str] = {}
    sequence: dict[str, list[tuple[str, str]]] = {}
    for group in sorted(set(mine) | set(theirs)):
        a, b = mine.get(group, []), theirs.get(group, [])
        matcher = difflib.SequenceMatcher(None, [op for _, op in a], [op for _, op in b], autojunk=False)
        events = sequence.setdefault(group, [])
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag == "equal":
                rename.update({b[j1 + d][0]: a[i1 + d][0] for d in range(i2 - i1)})
                events.extend(("both", p) for p, _ in a[i1:i2])
            else:
                events.extend(("sharded", p) for p, _ in b[j1:j2])
                events.extend(("reference", p) for p, _ in a[i1:i2])
    records = {}
    for (step, phase, name), t in other.records.items():
        if phase in ("ops", "op_inputs"):
            prefix, _, tail = name.rpartition(":")
            if prefix not in rename:
                continue
            name = f"{rename[prefix]}:{tail}"
        records[(step, phase, name)] = t
    return Trace(other.side, records, dict(other.meta)), sequence


def _judge(case: Case, ref: Trace, got: Trace, phases: tuple[str, ...], calibrate: bool) -> list[Finding]:
    """The zoom's records judged as every record is (verify/compare/comparators.py), calibrated
    by the reference's calibration runs with the same probes."""
    from fsdp_verify.runner import calibration_runs

    def calibration() -> list[Trace]:
        return [align_ops(ref, _only(t, phases))[0] for t in calibration_runs(case)]

    return compare_traces(_only(ref, phases), _only(got, phases), calibration if calibrate else None)


# ---- naming the module --------------------------------------------------------------------------
def _parent(fqn: str, known: set[str]) -> str | None:
    """The innermost recorded module strictly enclosing `fqn`: the root for a child of it, None
    for the root (what encloses it is the loss and the code around the model)."""
    if fqn == "":
        return None
    parts = fqn.split(".")
    for n in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:n]) in known:
            return ".".join(parts[:n])
    return ""


def _pass_key(pid: str) -> tuple[int, int]:
    mb, rank = pid.split(".r")
    return int(mb), int(rank)


def name_module(findings: list[Finding], order: dict[str, list[str]]) -> dict[str, Any] | None:
    """The first module whose forward output parts (earliest micro-batch, then position in the
    pass, then rank); else, in backward order, the first whose input gradient parts while its
    output gradient agrees, or, where an output gradient parts first, the module enclosing the
    code that computed it."""
    by_name = {f.name: f for f in findings}
    known = {e[2:].rsplit("#", 1)[0] for events in order.values() for e in events if e[0] == "F"}

    def parted(prefix: str, kind: str) -> tuple[list[Finding], list[Finding]]:
        mine = [f for n, f in by_name.items() if n.startswith(prefix + ":" + kind)]
        return mine, [f for f in mine if not f.ok]

    def worst(fs: list[Finding]) -> float | None:
        ratios = [f.ratio for f in fs if f.kind == "deviation"]
        return max(ratios) if ratios else None

    for direction in ("forward", "backward"):
        best = None
        for pid, events in order.items():
            for pos, event in enumerate(events):
                kind, call_id = event[0], event[2:]
                fqn, k = call_id.rsplit("#", 1)
                via = fqn  # the module whose records part (the named one encloses it when they differ)
                prefix = f"{pid}:{call_id}"
                hit = None
                if direction == "forward" and kind == "F":
                    _, bad = parted(prefix, "o")
                    _, bad_in = parted(prefix, "i")
                    if bad and not bad_in:
                        hit = (fqn, bad, "its output parts from the reference while its inputs agree")
                    elif bad or bad_in:  # already parted on the way in: in the enclosing code
                        parent = _parent(fqn, known)
                        while parent is not None and parted(f"{pid}:{parent}#0", "i")[1]:  # parted there too
                            fqn, parent = parent, _parent(parent, known)
                        why = f"the inputs of {_fqn(fqn)} part first: computed by its enclosing module"
                        if parent is None:
                            parent, why = "", "the root's inputs part: a forward pre-hook on it or the code calling it"
                        hit = (parent, bad or bad_in, why)
                elif direction == "backward" and kind == "B":
                    gout, bad_out = parted(prefix, "gout")
                    _, bad_in = parted(prefix, "gin")
                    if bad_in and not bad_out:
                        hit = (fqn, bad_in, "its input gradient parts while its output gradient agrees")
                elif direction == "backward" and kind == "P":
                    _, bad_out = parted(prefix, "gout")
                    if bad_out:
                        parent = _parent(fqn, known)
                        why = f"the gradient with respect to the output of {_fqn(fqn)} parts first: computed by "
                        why += "its enclosing module" if parent is not None else "the loss, outside the model"
                        hit = (parent, bad_out, why)
                if hit is not None:
                    mb, rank = _pass_key(pid)
                    key = (mb, pos, rank)
                    if best is None or key < best[0]:
                        best = (
                            key,
                            dict(
                                direction=direction,
                                module=hit[0],
                                call=int(k),
                                microbatch=mb,
                                rank=rank,
                                module_ratio=worst(hit[1]),
                                why=hit[2],
                                expert=_expert(hit[1]) if hit[0] == fqn else None,
                                via=via,
                            ),
                        )
                    break
        if best is not None:
            return best[1]
    return None


def _expert(parted: list[Finding]) -> int | None:
    """The first expert among a grouped experts module's parted chunks ("...:o0.e3":
    verify/zoom/experts.py); None for any other module."""
    experts = [int(f.name.rsplit(".e", 1)[1]) for f in parted if re.search(r":[a-z]+\d+\.e\d+$", f.name)]
    return min(experts) if experts else None


def module_table(findings: list[Finding]) -> list[dict[str, Any]]:
    """Per module, the worst ratio of its forward outputs and of its gradients over every pass."""
    rows: dict[str, dict[str, Any]] = {}
    for f in findings:
        if f.phase not in ("modules", "module_grads"):
            continue
        fqn = f.name.split(":")[1].rsplit("#", 1)[0]
        row = rows.setdefault(fqn, {"module": fqn, "forward": 0.0, "backward": 0.0, "ok": True})
        col = "forward" if f.phase == "modules" else "backward"
        row[col] = max(row[col], f.ratio if f.kind == "deviation" else float("inf"))
        row["ok"] = row["ok"] and f.ok
    return sorted(rows.values(), key=lambda row: _tree_key(row["module"]))


def _tree_key(fqn: str) -> list[tuple[int, Any]]:
    """Depth-first order of the module tree: parents before children, layers.2 before layers.10."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in fqn.split(".")] if fqn else []


def place(case: Case, rank: int, expert: int | None = None, module: str | None = None) -> str:
    """Where a rank's records lie beside the data-parallel ranks: under tensor parallelism a
    module's value is compared as each tp rank holds it (verify/zoom/watch.py), so the tp rank
    whose local value parts first is named with its data-parallel rank; a grouped experts
    module's rows expert by expert (verify/zoom/experts.py), so the expert (and under ep the ep
    rank holding it, which computed the rows of `rank`); under pipeline parallelism the stage
    holding the module (a pass's rank is its data-parallel index there)."""
    if case.tp > 1:
        at = case.parallel.coords(rank)
        return f"tp rank {at.tp_rank} of data-parallel rank {at.dp_rank}"
    if case.pp > 1 and module is not None:
        stage = stage_of_module(case, module)
        if stage is None:
            return ""
        holder = case.parallel.rank_of(stage=stage % case.pp, dp_rank=rank)  # a pass's rank is its dp index
        return f"stage {stage}, on rank {holder} (data-parallel rank {rank})"
    if expert is None:
        return ""
    if case.ep == 1:
        return f"expert {expert}"
    held = case.model.experts // case.ep
    group = rank - rank % case.ep  # the ep ranks are consecutive ranks of the shard dim
    return f"expert {expert}, held by rank {group + expert // held} (ep rank {expert // held})"


def _between_stages(case: Case, zoom: Zoom) -> None:
    """A pipeline's root encloses no code the ranks run but the schedule's: what parts first
    outside every module is what a stage receives from the previous one (an activation), the
    next one (a gradient), or the last stage's loss. Names the module at that boundary and the
    stage holding it; no op pass (the parting is not inside the module)."""
    from fsdp_verify.engines.pipeline_parallel import stages_per_rank

    last = case.pp * stages_per_rank(case.pp_schedule) - 1
    zoom.module = zoom.via
    stage = stage_of_module(case, zoom.via)
    zoom.place = place(case, zoom.rank, None, zoom.via)
    if zoom.direction == "backward" and stage == last:
        zoom.why = (
            f"the gradient of its output parts first: computed by the schedule's loss on the last stage ({stage})"
        )
    elif zoom.direction == "backward":
        zoom.why = (
            f"the gradient of its output, which stage {stage} receives from stage {stage + 1}, parts first:"
            f" the boundary between stages {stage} and {stage + 1}"
        )
    elif stage:
        zoom.why = (
            f"its inputs, which stage {stage} receives from stage {stage - 1}, part first:"
            f" the boundary between stages {stage - 1} and {stage}"
        )
    else:
        zoom.why = "its inputs part first: stage 0's input, outside every module (the code calling the schedule)"
    zoom.op_where = "the parting is between the stages, not inside the module: no op pass"


def stage_of_module(case: Case, fqn: str) -> int | None:
    """The pipeline stage holding module `fqn`: its parameters' (or, for one without any, the
    nearest enclosing module's); None for the root, which is no stage's."""
    from fsdp_verify.reference.pipeline_parallel import stage_of

    stages = stage_of(case)
    while fqn:
        mine = sorted(s for n, s in stages.items() if n.startswith(fqn + "."))
        if mine:
            return mine[0]
        fqn = fqn.rpartition(".")[0]
    return None


# ---- naming the op ------------------------------------------------------------------------------
def name_op(
    zoom: Zoom, ref: Trace, got: Trace, findings: list[Finding], sequence, out_dir: Path | None, raw: Trace
) -> None:
    """The first op of the named module's call, in the parting pass, whose output parts, or that
    only one side ran (a hook on one rank, a cast the reference does not make)."""
    group = f"{pass_id(zoom.microbatch, zoom.rank)}:c{zoom.call}"
    by_prefix: dict[str, list[Finding]] = {}
    for f in findings:
        if f.phase == "ops":
            by_prefix.setdefault(f.name.rsplit(":", 1)[0], []).append(f)
    for i, (side, prefix) in enumerate(sequence.get(group, [])):
        outs = by_prefix.get(prefix, []) if side == "both" else []
        ratio = max((f.ratio for f in outs if f.kind == "deviation"), default=None)
        ok = side == "both" and all(f.ok for f in outs)
        where = "both sides" if side == "both" else f"only on the {side} side"
        zoom.ops.append({"index": i, "op": prefix.split(":")[3], "ratio": ratio, "ok": ok, "where": where})
        if ok or zoom.op is not None or prefix.endswith("[recomputed]"):
            continue
        where = "parts" if side == "both" else where
        zoom.op, zoom.op_index, zoom.op_ratio, zoom.op_where = prefix.split(":")[3], i, ratio, where
        if side == "both":
            ins = sorted(k for k in ref.records if k[1] == "op_inputs" and k[2].startswith(prefix + ":"))
            zoom.op_inputs_agree = all(
                k in got.records
                and measure(ref.records[k], got.records[k]).normwise <= bound_tolerance(ref.records[k].dtype).limit
                for k in ins
            )
        zoom.saved = _save(zoom, ref, raw if side == "sharded" else got, prefix, side, out_dir)
    if zoom.op is None:
        zoom.op_where = "every operation inside agrees within its tolerance (the parting builds up over several)"


def _save(zoom: Zoom, ref: Trace, got: Trace, prefix: str, which: str, out_dir: Path | None) -> str | None:
    """The op's inputs and outputs, the reference's and the rank's (those the side that ran it
    alone has, for an op only one side ran), in one safetensors file."""
    if out_dir is None:
        return None
    tensors: dict[str, torch.Tensor] = {}
    for side, trace in (("reference", ref), ("sharded", got)):
        if which not in ("both", side):
            continue
        for (_s, phase, name), t in trace.records.items():
            if phase in ("ops", "op_inputs") and name.startswith(prefix + ":"):
                tail = name.rsplit(":", 1)[1]
                tensors[f"{side}.{'output' if tail[0] == 'o' else 'input'}{tail[1:]}"] = t.contiguous()
    if not tensors:
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"zoom-{zoom.case_hash}-op.safetensors"
    meta = {
        "op": zoom.op or "",
        "module": zoom.module or "",
        "rank": str(zoom.rank),
        "step": str(zoom.step),
        "microbatch": str(zoom.microbatch),
        "direction": zoom.direction or "",
        "where": zoom.op_where,
    }
    save_file(tensors, str(path), metadata=meta)
    return str(path)


# ---- the whole zoom -----------------------------------------------------------------------------
def zoom_step(verdict: Verdict | None, case: Case) -> int:
    """The step to zoom into: the first divergence's (a parting at step 0, in the initial state,
    shows in step 1's forward)."""
    first = verdict.first_divergence if verdict is not None else None
    return max(first.step, 1) if first is not None else case.steps


def zoom(
    case: Case,
    verdict: Verdict | None = None,
    step: int | None = None,
    pool=None,
    timeout_s: float | None = None,
    out_dir: Path | None = None,
    calibrate: bool = True,
) -> Zoom:
    """Zoom into `step` (default: the verdict's first divergence) of `case`."""
    if case.step is not None:
        raise CaseError("step", "the toolkit's own loop (zoom cannot yet probe a user's step)", case.step)
    step = step if step is not None else zoom_step(verdict, case)
    if not 1 <= step <= case.steps:
        raise CaseError("zoom", f"a step in 1..{case.steps}", step)
    result = Zoom(case.hash, step)
    first = verdict.first_divergence if verdict is not None else None
    if first is not None:
        result.phase, result.record = first.phase, first.name
        result.ratio = first.ratio if first.kind == "deviation" else None
    t0 = time.perf_counter()
    modules_case = zoom_case(case, step, str(step))
    # What ran the step: a resumed case's step after the save ran on what it resumed on
    case = modules_case.after_resume() if modules_case.resume_after is not None else modules_case
    ref, got = _run(modules_case, pool, timeout_s)
    findings = _judge(modules_case, ref, got, ("modules", "module_grads"), calibrate)
    result.seconds["modules"] = time.perf_counter() - t0
    result.modules = module_table(findings)
    named = name_module(findings, ref.meta.get("zoom", {}).get("order", {}))
    if named is None:
        result.why = "every module's outputs and gradients agree within their tolerances"
        return result
    for key, value in named.items():
        setattr(result, key, value)
    result.place = place(case, result.rank, result.expert, result.module)
    if result.module is None:
        return result  # the loss, outside the model: no module to look inside
    if case.pp > 1 and result.module == "":
        _between_stages(case, result)
        return result
    if case.ep > 1 and result.expert is not None:
        # Its ops run on other ranks' rows on the ranks, on the rank's own on the reference.
        result.op_where = (
            "its ops are not compared under ep (a rank computes its ep group's rows for the experts it holds)"
        )
        return result
    t1 = time.perf_counter()
    ops_case = zoom_case(modules_case, step, f"{step}/{result.direction}/{result.module}")
    ref, got = _run(ops_case, pool, timeout_s)
    aligned, sequence = align_ops(ref, got)
    findings = _judge(ops_case, ref, aligned, ("ops",), calibrate)
    name_op(result, ref, aligned, findings, sequence, out_dir, got)
    result.seconds["ops"] = time.perf_counter() - t1
    return result
