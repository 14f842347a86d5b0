"""Resumes: a save after some step and a run that loads it, on the same or another world size,
mesh, engine or degree (the draw `resumes`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from fsdp_verify.case import Case, CaseError
from fsdp_verify.properties.expert_parallel import ep_degrees
from fsdp_verify.properties.fsdp1 import fsdp1_modelled
from fsdp_verify.properties.meshes import hsdp_meshes
from fsdp_verify.properties.pins import asked, one_or_more, pinned
from fsdp_verify.properties.pipeline_parallel import schedule_fits


@st.composite
def resumes(
    draw: Callable,
    case: Case,
    world_sizes: tuple[int, ...],
    hsdp: bool = False,
    tps: tuple[int, ...] = (1,),
    pins: dict[str, Any] | None = None,
) -> Case:
    """`case` with a checkpoint and resume (docs/resume.md): saved after a drawn step (two steps
    at least), resumed on a drawn world size and mesh, and from FSDP1 on FSDP2 or FSDP1. The
    global batch becomes a multiple of both runs' data-parallel ranks (times the micro-batches)
    where the drawn one is not: one batch the same for both runs. Where tp is asked (`tps`, the
    degrees drawn among), the tp degree the run resumes with too, among those dividing the drawn
    world size (the model splits over each: `_cases`); a clip the resumed plan cannot take
    (parameters off its tp mesh) is dropped. Where expert parallelism was asked (`pins`: `--ep`,
    `resume_ep`), grouped experts resume on a drawn ep degree (`_resumed_ep`); a drawn pipeline
    on a drawn pipeline degree (`_resumed_pp`). A user's step takes no resume: not drawn."""
    from fsdp_verify.engines import refuse_untakeable

    assume(case.step is None)
    steps = max(case.steps, 2)
    after = draw(st.integers(1, steps - 1))
    world = draw(st.sampled_from(world_sizes))
    # Drawn only where tp is asked, so a seed's draws without it stay what they were.
    tp = draw(st.sampled_from([t for t in tps if world % t == 0])) if tps != (1,) else 1
    pp = draw(_resumed_pp(case, pins or {}, world // tp))  # the stages divide a tp rank's ranks
    stage_ranks = world // tp // (case.pp if pp is None else pp)  # the data-parallel part of the mesh
    mesh = draw(hsdp_meshes(stage_ranks)) if hsdp else None
    engine = draw(st.sampled_from((None, "fsdp2"))) if case.engine == "fsdp1" else None
    batch = case.data.batch_size
    ranks = world // tp  # the resumed run's data-parallel ranks times its stages (a pipeline's batch is whole)
    if batch % (ranks * case.microbatches):
        batch = math.lcm(case.world_size // case.tp, ranks) * case.microbatches
    changes = dict(
        steps=steps,
        resume_after=after,
        resume_world_size=world,
        resume_mesh_shape=mesh,
        resume_engine=engine,
        resume_tp=tp if tp != case.tp else None,
        resume_ep=draw(_resumed_ep(case, pins or {}, mesh[-1] if mesh else stage_ranks)),
        resume_pp=pp,
        **{"data.batch_size": batch},
    )
    try:
        try:
            resumed = case.with_(**changes)
        except CaseError as e:
            if e.field_path != "clip_norm" or case.clip_norm is None:
                raise
            resumed = case.with_(clip_norm=None, **changes)
    except CaseError:
        assume(False)
        raise
    assume(resumed.engine != "fsdp1" or fsdp1_modelled(resumed))  # the saving run's checkpoint
    resumed_run = resumed.after_resume()
    assume(resumed_run.engine != "fsdp1" or fsdp1_modelled(resumed_run))
    try:
        refuse_untakeable(resumed_run)  # e.g. an int reshard_after_forward the new shard group does not divide
    except CaseError:
        assume(False)
    return resumed


def _resumed_ep(case: Case, pins: dict[str, Any], shard: int) -> SearchStrategy[int | None]:
    """The ep degree a resume of grouped experts takes on the resumed shard dimension `shard`:
    only where ep was asked (a pin of `ep` or `resume_ep`; an engine that does not take `ep` has it
    pinned to 1 by `_knob_pins`, so a plain plug-in is never drawn one), any degree that divides
    the experts and `shard` (or 1: every expert on every rank), or the pin; None (as before)
    elsewhere. The Case refuses a pinned one the resumed run cannot take: not this draw."""
    if case.model.grouped_experts is None or not asked(pins, {"ep": 1, "resume_ep": None}):
        return st.none()
    return pinned(pins, "resume_ep", one_or_more(ep_degrees(case, [case.model.experts], shard)))


def _resumed_pp(case: Case, pins: dict[str, Any], world: int) -> SearchStrategy[int | None]:
    """The pipeline degree a pipelined case resumes with on `world` ranks (those of one tp rank,
    beside tp): where a pipeline was
    drawn (so asked, for an engine that takes `pp`), any degree that divides `world` and that the
    schedule, the blocks and the micro-batches fit (or 1: no stages), or the pin; None (as
    before) elsewhere. A resume into stages from a case without them is `check --resume-pp`'s."""
    if case.pp == 1 or case.model.is_custom:  # a user's split: asked for its own stage count only
        assume(pins.get("resume_pp") in (None, 1, case.pp))
        return st.none()
    blocks = case.model.n_blocks
    degrees = [
        d
        for d in range(2, world + 1)
        if world % d == 0 and schedule_fits(case.pp_schedule, d, blocks, case.microbatches)
    ]
    return pinned(pins, "resume_pp", one_or_more(degrees))
