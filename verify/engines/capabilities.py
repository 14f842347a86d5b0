"""Capabilities: which cases an engine can take at all, as it declares them, the way it declares its
arithmetic and contracts (verify/engines/arithmetic.py, contracts.py).

A case the engine cannot take is bad input, not a rank failure: the parent process refuses it
before any rank starts (exit 2, naming the field and what the engine accepts), and the case
strategies draw only what the engine takes. An engine states it as an attribute of its entry
point, `fn.capabilities = Capabilities(mesh_dims=(1,))`; one that declares nothing is taken to
take what FSDP2 takes, as it is held to FSDP2's models.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_verify.validation import CaseError

MESH_FORMS = {1: "(shard,)", 2: "(replicate, shard)"}


@dataclass(frozen=True)
class Capabilities:
    # The mesh ranks the engine shards on: 1 = a 1-D mesh (shard,); 2 = (replicate, shard), every
    # shape (HSDP, and the degenerate (1, W), (W, 1) and (1, 1)).
    mesh_dims: tuple[int, ...] = (1, 2)
    # Whether it applies `precision.output_dtype` (FSDP1 has none).
    output_dtype: bool = True
    # Whether an int `reshard_after_forward` must divide the shard dimension (FSDP2's
    # `_get_post_forward_mesh_info` raises otherwise; FSDP1 and the flat engine take an int as True).
    reshard_int_divides_shard: bool = True
    # Whether it takes fully_shard's knobs (`offload`, `shard_placement`, `replica_sync_last`,
    # `reshard_after_backward_last`, `grad_reduction`, `ignored`, `prefetch`): FSDP1 and the flat
    # engine shard one FlatParameter per unit (no per-parameter placement) and run on one device.
    shard_knobs: bool = True
    # Whether it trains parameters unfrozen mid-run (`unfreeze_step`): an engine that fixes which
    # parameters train when it shards (a FlatParameter's requires_grad) cannot.
    unfreezes: bool = True
    # Whether the reference models it with routed experts (`model.experts`).
    routed_experts: bool = True

    def __post_init__(self) -> None:
        if not self.mesh_dims or any(d not in MESH_FORMS for d in self.mesh_dims):
            raise ValueError(f"capabilities: mesh_dims must be a non-empty subset of (1, 2), got {self.mesh_dims!r}")

    def accepts(self) -> str:
        return " or ".join(f"a {d}-D mesh {MESH_FORMS[d]}" for d in sorted(self.mesh_dims))

    def refuse(self, case, engine: str) -> None:
        """Raise CaseError naming the field when `case` asks for what the engine cannot take."""
        if len(case.mesh) not in self.mesh_dims:
            raise CaseError("mesh_shape", f"{self.accepts()}: what engine {engine!r} takes", case.mesh_shape)
        if not self.output_dtype and case.precision.output_dtype is not None:
            raise CaseError(
                "precision.output_dtype", f"null: engine {engine!r} has no output_dtype", case.precision.output_dtype
            )
        if not self.shard_knobs:
            for name, off in (
                ("offload", False),
                ("shard_placement", "dim0"),
                ("replica_sync_last", False),
                ("reshard_after_backward_last", False),
                ("grad_reduction", "avg"),
                ("ignored", ()),
                ("prefetch", None),
            ):
                if getattr(case, name) != off:
                    raise CaseError(name, f"{off!r}: engine {engine!r} has no fully_shard {name}", getattr(case, name))
        if not self.unfreezes and case.unfreeze_step is not None:
            raise CaseError(
                "unfreeze_step",
                f"null: engine {engine!r} fixes which parameters train when it shards",
                case.unfreeze_step,
            )
        if not self.routed_experts and case.model.experts:
            raise CaseError(
                "model.experts",
                f"0: the reference does not model engine {engine!r} with routed experts yet",
                case.model.experts,
            )
        rsf, shard = case.reshard_after_forward, case.mesh[-1]
        if self.reshard_int_divides_shard and not isinstance(rsf, bool) and shard % rsf:
            raise CaseError(
                "reshard_after_forward",
                f"true, false or an int dividing the shard dimension {shard} (mesh {case.mesh}): what engine"
                f" {engine!r} takes",
                rsf,
            )


FSDP2 = Capabilities()


def capabilities_of(engine: object) -> Capabilities:
    declared = getattr(engine, "capabilities", None)
    return declared if isinstance(declared, Capabilities) else FSDP2
