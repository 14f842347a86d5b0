"""Probes: observers of a sharded run on one rank, which record what the loop itself does not
(dtypes seen in forward, RNG fingerprints, buffers, the ownership map). Every rank builds the
same probes and calls their hooks in the same order, so a hook may run collectives; records go
into the trace, which only rank 0 keeps. To add one, subclass `base.Probe` in its own module and
list it in PROBES."""

from __future__ import annotations

from fsdp_verify.probes.base import Probe
from fsdp_verify.probes.buffers import BuffersProbe
from fsdp_verify.probes.build import BuildProbe
from fsdp_verify.probes.comm import CommProbe
from fsdp_verify.probes.compile import CompileProbe
from fsdp_verify.probes.knobs import KnobsProbe
from fsdp_verify.probes.memory import MemoryProbe
from fsdp_verify.probes.ownership import OwnershipProbe
from fsdp_verify.probes.precision import PrecisionProbe
from fsdp_verify.probes.rng import RngProbe
from fsdp_verify.zoom.probe import ZoomProbe

PROBES: list[type[Probe]] = [
    BuildProbe,
    KnobsProbe,
    OwnershipProbe,
    RngProbe,
    BuffersProbe,
    PrecisionProbe,
    CommProbe,
    MemoryProbe,
    CompileProbe,
    ZoomProbe,
]

__all__ = ["PROBES", "Probe"]
