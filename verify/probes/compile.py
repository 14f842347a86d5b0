"""Compile probe: what torch.compile did on each rank of a compiled case (verify/training/compile.py),
step by step: the frames Dynamo compiled (where, how many operations, and for a recompilation the
guard that failed), and the graph breaks (why, how often). Read from Dynamo's own records,
`torch._dynamo.utils.get_compilation_metrics()` and `counters["graph_break"]`, which each case
starts empty (`fresh_compiler`); the compile check (verify/checks/compile.py) reports them, and a
frame compiled again after the run's first step is a finding: a guard that fails every step
compiles every step."""

from __future__ import annotations

from typing import Any

from fsdp_verify.probes.base import Probe


class CompileProbe(Probe):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.on = self.case.compile is not None
        self.first_step: int | None = None  # the run's first step (a resumed run starts later)
        self.step = 0  # compilations before the first forward are the build's (none expected)
        self.frames: list[list] = []  # [step, name, where, ops, recompile reason or None]
        self.breaks: dict[str, dict[str, int]] = {}  # step -> reason -> count
        self.limits: list[list] = []  # [step, recompile reason]: a compile refused at Dynamo's recompile limit

    def before_forward(self, step: int, microbatch: int) -> None:
        if not self.on or microbatch != 0:
            return
        self._take()
        self.step = step
        if self.first_step is None:
            self.first_step = step

    def after_step(self, step: int) -> None:
        if self.on:
            self._take()

    def finish(self) -> None:
        if self.on:
            self._take()

    def _take(self) -> None:
        """The frames compiled and the graph breaks since the last call, as this step's."""
        from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics

        for m in get_compilation_metrics():
            if m.fail_type is None and not m.has_guarded_code:
                continue  # a frame Dynamo looked at and left to run as it is
            if (m.fail_reason or "").startswith(LIMIT_FAILURE):
                # Dynamo refused to compile a frame again (torch 2.13 records no frame name here):
                # the guard that failed against its last graph says why it was asked to
                self.limits.append([self.step, m.recompile_reason])
                continue
            where = f"{m.co_filename}:{m.co_firstlineno}"
            self.frames.append([self.step, m.co_name, where, m.graph_op_count or 0, m.recompile_reason])
        clear_compilation_metrics()
        # A break Dynamo resumes after ("graph_break"), and one it could not trace on from, after
        # which it runs the rest of the frame eagerly, or all of it ("unimplemented")
        for kind in ("graph_break", "unimplemented"):
            if counters[kind]:
                mine = self.breaks.setdefault(str(self.step), {})
                for reason, count in counters[kind].items():
                    said = _reason(reason)
                    mine[said] = mine.get(said, 0) + count
                counters[kind].clear()

    def to_gather(self) -> Any:
        if not self.on:
            return None
        from torch._dynamo.utils import counters

        # Graphs Inductor found in its on-disk cache, against those it compiled (verify/training/compile.py)
        cache = {"hit": counters["inductor"]["fxgraph_cache_hit"], "miss": counters["inductor"]["fxgraph_cache_miss"]}
        return {
            "first_step": self.first_step,
            "frames": self.frames,
            "breaks": self.breaks,
            "cache": cache,
            "limits": self.limits,
            "recompile_limit": recompile_limit(),
        }

    def gathered(self, per_rank: list[Any]) -> None:
        if self.on:
            self.meta("compile", per_rank)


# How Dynamo's compilation metrics begin the failure of a compile refused at its recompile limit
# (the graph-break type of torch 2.13's `raise_unimplemented_cache_limit_exceeded`).
LIMIT_FAILURE = "Dynamo recompile limit exceeded"


def recompile_limit() -> int | None:
    """Dynamo's graphs per code object (`torch._dynamo.config.recompile_limit`, 8 in torch 2.13)."""
    import torch._dynamo.config

    return getattr(torch._dynamo.config, "recompile_limit", None)


def _reason(text: str) -> str:
    """A graph break's first line, and the frame Dynamo gave up on where it says so."""
    lines = [line.strip() for line in text.strip().splitlines()]
    first = lines[0] if lines else "?"
    skipped = next((line for line in lines if line.startswith("Developer debug context: frame skipped:")), None)
    if skipped is not None:
        first += f" ({skipped.removeprefix('Developer debug context: ')}, run eagerly)"
    return first
