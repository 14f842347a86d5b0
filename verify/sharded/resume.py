"""A resumed case's sharded side (docs/resume.md): the run up to the save on one pool, the run
that resumes from its checkpoint on the pool of the resumed world size (the same pool when it is
the same size: the process group is the pool's, so a new size is a new pool, not a new launcher),
their traces put together, judged against the reference that never stopped."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable
from typing import Any

from fsdp_verify.case import Case
from fsdp_verify.sharded.collect import RANK_ROWS
from fsdp_verify.sharded.pool import RankFailure, RankPool, get_pool, memory_dir
from fsdp_verify.trace import Trace
from fsdp_verify.validation import CaseError


def run_resumed(
    case: Case,
    pool: RankPool | None = None,
    timeout_s: float | None = None,
    meanwhile: Callable[[], Any] = lambda: None,
) -> tuple[Trace, Trace, Any]:
    """The two sharded runs' traces (up to the save, and from the load on) and what `meanwhile`
    returned: it runs here while the first run's ranks work (the reference, as `check_case`
    overlaps it)."""
    before, after = case.before_resume(), case.after_resume()
    first = pool if pool is not None and pool.world_size == before.world_size else get_pool(before.world_size)
    second = get_pool(after.world_size, first.timeout_s) if after.world_size != first.world_size else first
    with tempfile.TemporaryDirectory(prefix="fsdp-verify-checkpoint-", dir=memory_dir()) as where:
        first.submit(before, {"save": where, "steps": case.steps})  # the schedule spans them all
        try:
            done = meanwhile()
        except CaseError:  # the user's code failed on the reference: bad input, whatever the ranks did
            with contextlib.suppress(RankFailure):
                first.result(timeout_s)
            raise
        except BaseException:
            first.result(timeout_s)  # keep the pool in step before propagating
            raise
        saved = first.result(timeout_s)
        resumed = second.run(after, timeout_s, {"load": where})
    return saved, resumed, done


def merged(saved: Trace, resumed: Trace) -> Trace:
    """One sharded trace: the first run's records (steps 0 to the save), the second's (the
    loaded state, then every later step); the second run's meta, with both runs' item counts
    and ranks' rows."""
    out = Trace("sharded", {**saved.records, **resumed.records}, dict(resumed.meta))
    for what in ("items", RANK_ROWS):  # keyed by step: each run's own
        out.meta[what] = {**saved.meta.get(what, {}), **resumed.meta.get(what, {})}
    return out


def steps_of(trace: Trace, keep) -> Trace:
    """The records of the steps `keep(step)` accepts (the loaded state left out), same meta."""
    records = {k: v for k, v in trace.records.items() if keep(k[0]) and k[1] != "resumed"}
    return Trace(trace.side, records, trace.meta)


def as_saved(ref: Trace, saved: Trace, step: int) -> Trace:
    """The reference with the parameters and optimizer state it expects right after the load
    replaced by those the sharded run saved (its own records after step `step`): a load is a copy
    of what was saved, bit for bit, and what was saved is held to the reference by the usual
    tolerances at that step (a correct engine may round otherwise: sweep seed 20262901 saved an
    Adam moment 4 ulp from the reference's, within its tolerance, and loaded it exactly)."""
    records = {
        k: v for k, v in ref.records.items() if not (k[1] == "resumed" and k[2].startswith(("params.", "optim.")))
    }
    for (s, phase, name), value in saved.records.items():
        if s == step and phase in ("params", "optim_state"):
            records[(step, "resumed", f"{'params' if phase == 'params' else 'optim'}.{name}")] = value
    return Trace(ref.side, records, ref.meta)


__all__ = ["as_saved", "merged", "run_resumed", "steps_of"]
