"""Is a run recorded as sharded sharded? Two ways a sharded loop silently is not, read from the
records of the run alone (no collective is issued to find out):

* every parameter a plain tensor on every rank of a run meant to shard (the Recorder's
  `sharded`, or an integration naming its library's setting): FSDP was not applied. Accelerate
  1.15 on a CPU-only machine falls back so: with `cpu=True` its FSDP plugin is ignored and the
  model is wrapped in DistributedDataParallel; the transformers Trainer with `fsdp` and
  `use_cpu=True` likewise. (Some parameters plain, the rest sharded, is a note, not this verdict:
  `ignored_params` keeps parameters out on purpose; whether anything averages them, the replica
  check below says.)
* replicas that drift apart: rows that more than one rank holds (a plain tensor, a replicated
  DTensor) must hold the same values on every rank after every step of a data-parallel run; ranks
  whose copies part trained apart, no collective between them (a strategy that wraps nothing, a
  module left outside every `fully_shard` unit). The gradients say whether the part came before
  the update (they were never averaged) or in it.

Either gives compare's NOT SHARDED verdict, which no agreement of the records can turn into
EQUIVALENT: the reference was compared with something other than a sharded run.
"""

from __future__ import annotations

from fsdp_verify.compare.finding import Finding
from fsdp_verify.recorder import rules
from fsdp_verify.recorder.align import Step
from fsdp_verify.recorder.store import Run

COMPARATOR = "ShardingCheck"


def intent(run: Run) -> dict | None:
    """settings.sharded of the run (recorder.sharding_intent); None for runs recorded before it."""
    return run.meta[0]["settings"].get("sharded")


def plain_on_every_rank(run: Run) -> list[str] | None:
    """The parameters no rank holds as a DTensor, in the run's order (None: not recorded)."""
    if any("plain_params" not in m for m in run.meta):
        return None
    plain = set.intersection(*(set(m["plain_params"]) for m in run.meta))
    return [n for n in run.param_names if n in plain]


def unsharded(run: Run) -> Finding | None:
    """A finding when a run of more than one rank, meant to shard, holds every parameter as a
    plain tensor on every rank: FSDP was not applied at all."""
    want = intent(run)
    plain = plain_on_every_rank(run)
    if run.world_size < 2 or not want or not want["expected"] or not plain or len(plain) < len(run.param_names):
        return None
    return Finding(
        step=0,
        phase="sharding",
        name="parameters",
        ok=False,
        kind="sharding",
        comparator=COMPARATOR,
        mode="check",
        message=(
            f"{run.path} is meant to shard its parameters ({want['by']}), but every one of its {len(plain)}"
            f" parameters is a plain tensor on every one of its {run.world_size} ranks: FSDP was not applied"
            " (a fallback to DistributedDataParallel, or each process training its own copy)"
        ),
        why="a run meant to shard holds its parameters as DTensors sharded over the ranks",
    )


def partly_plain(run: Run) -> str | None:
    """A note when some parameters, not all, are plain tensors on every rank of a run of more
    than one rank: left out of sharding on purpose (`ignored_params`, their gradients averaged by
    the loop) or by mistake (outside every `fully_shard` unit, averaged by nothing). Which one, the
    replica check tells: their copies must agree on every rank at every step."""
    plain = plain_on_every_rank(run)
    if run.world_size < 2 or not plain or len(plain) == len(run.param_names):
        return None
    shown = ", ".join(repr(p) for p in plain[:5]) + (f" and {len(plain) - 5} more" if len(plain) > 5 else "")
    return (
        f"{len(plain)} of the {len(run.param_names)} parameters of {run.path} are plain tensors on every one"
        f" of its {run.world_size} ranks, not sharded: {shown}; held to the replica rule (the same values on"
        " every rank at every step) in the sharding column"
    )


def drift(step: Step, run: Run, dtype) -> list[Finding]:
    """Per phase of this step (initial parameters, gradients, parameters after the update,
    optimizer state) that holds replicated tensors, one finding: the tensor whose ranks' copies
    differ the most, held to the replica rule for `dtype` (the parameters')."""
    if run.world_at(step.call) < 2:
        return []
    tol = rules.replica(dtype)
    out = []
    for (k, kind), named in sorted(step.groups.items()):
        phase = "init" if k == 0 else ("optim_state" if kind.startswith("optim.") else kind)
        spreads = {name: rows.spread for name, rows in named.items() if rows.spread is not None}
        if not spreads:
            continue
        name, (dev, a, b) = max(spreads.items(), key=lambda item: item[1][0])
        parted = sum(1 for d, _, _ in spreads.values() if d > tol.limit)
        base = dict(step=step.call, phase="sharding", name=f"{name} [{phase}]", comparator=COMPARATOR)
        base.update(kind="deviation", normwise=dev, tolerance=tol.limit, mode=tol.mode, why=tol.why)
        if not parted:
            out.append(Finding(ok=True, message=f"{len(spreads)} replicated tensors agree on every rank", **base))
            continue
        what = {
            "init": "the initial values of",
            "grads": f"the gradients (optimizer step {k}) of",
            "params": f"the parameters after optimizer step {k} of",
        }.get(phase, f"the optimizer state ({kind.split('.', 1)[-1]}, step {k}) of")
        others = f" and {parted - 1} more replicated tensors" if parted > 1 else ""
        why = {
            "grads": "no collective made them equal before the update: the ranks train apart",
            "init": "the ranks built different models",
        }.get(phase, "the ranks train apart")
        message = f"{what} {name!r}{others} differ between ranks {a} and {b}, which both hold them: {why}"
        out.append(Finding(ok=False, message=message, **base))
    return out
