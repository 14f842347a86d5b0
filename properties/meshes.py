"""Device meshes a case draws: HSDP's (replicate, shard) shapes, and which engines take a 2-D one."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from fsdp_verify.properties.pins import PinError


def hsdp_meshes(world_size: int, shard_multiple: int = 1) -> SearchStrategy[tuple[int, int] | None]:
    """None (1-D) or a 2-D mesh (replicate, shard) for every factoring of the world size, the
    degenerate ones included: (1, W) (FSDP2 all-reduces over one replica), (W, 1) (pure
    replication, no all-gather) and (1, 1) at one rank; `cases(hsdp=True)` draws it for an engine
    that takes 2-D meshes (verify/engines/capabilities.py). Shrinks towards None. With
    `shard_multiple` (a pinned int reshard_after_forward), only meshes whose shard dimension it
    divides; the world size must be a multiple of it."""
    shapes = [(r, world_size // r) for r in range(1, world_size + 1) if world_size % r == 0]
    return st.sampled_from([None, *(m for m in shapes if m[1] % shard_multiple == 0)])


def takes_2d_meshes(engine: str, pins: dict[str, Any]) -> bool:
    """Whether the engine declares it takes 2-D meshes; a pinned mesh it cannot take is refused
    now, naming the field (verify/engines/capabilities.py)."""
    from fsdp_verify.engines import engine_capabilities

    capabilities = engine_capabilities(engine)
    mesh = pins.get("mesh_shape")
    if mesh is not None and not isinstance(mesh, SearchStrategy) and len(mesh) not in capabilities.mesh_dims:
        raise PinError(f"mesh_shape: expected {capabilities.accepts()} (what engine {engine!r} takes), got {mesh!r}")
    return 2 in capabilities.mesh_dims
