"""Who owns each parameter: the map an engine exposes (through its EngineView) and that the
ownership check (verify/checks/) proves to be a partition."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class ParamOwnership:
    fqn: str  # the original parameter FQN (as in the unsharded model)
    units: tuple[str, ...]  # shard units holding it: exactly one when correct (module FQN or FlatParameter name)
    shape: tuple[int, ...]
    local_numel: tuple[int, ...]  # elements of this parameter each rank holds, padding excluded
    padding: tuple[int, ...] = ()  # padding elements each rank holds for it (empty if unknown)


@dataclass
class OwnershipMap:
    """Per parameter FQN, as seen by the engine. `unmanaged` lists parameters no unit owns."""

    params: dict[str, ParamOwnership] = field(default_factory=dict)
    unmanaged: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"params": {k: asdict(v) for k, v in self.params.items()}, "unmanaged": list(self.unmanaged)}

    @classmethod
    def from_json(cls, data: dict) -> OwnershipMap:
        params = {
            k: ParamOwnership(
                fqn=v["fqn"],
                units=tuple(v["units"]),
                shape=tuple(v["shape"]),
                local_numel=tuple(v["local_numel"]),
                padding=tuple(v.get("padding", ())),
            )
            for k, v in data.get("params", {}).items()
        }
        return cls(params=params, unmanaged=tuple(data.get("unmanaged", ())))
