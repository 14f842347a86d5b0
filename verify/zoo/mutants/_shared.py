"""The helpers several mutant modules share: the FSDP2 units of a sharded model, a view that
changes one method of the engine's own, an FSDP2 engine whose resume loads through a mutated
Checkpointer (the resumes beside tp, ep and pp sit with their parallelism), a DTensor's local
piece."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp_verify.engines.fsdp2 import fully_shard_engine
from fsdp_verify.engines.spec import ShardSpec
from fsdp_verify.engines.view import EngineView


def _units(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _over_engine_view(model: nn.Module, view_type: type, *args) -> None:
    """`view_type`'s methods over the view the engine gave (a pipeline's under pp, which records
    across the stages), so that a mutant of one method changes that method only."""
    own = getattr(model, "verify_view", None)
    base = type(own()) if callable(own) else EngineView
    cls = view_type if issubclass(view_type, base) else type(view_type.__name__, (view_type, base), {})
    model.verify_view = lambda: cls(model, *args)


def _resuming(checkpointer: type) -> callable:
    """An FSDP2 engine whose checkpoints load through `checkpointer` (a Checkpointer with one
    step mutated): the save and the training are FSDP2's own."""

    def engine(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
        fully_shard_engine(model, mesh, spec)
        # the view the engine made (a pipeline's: verify/engines/pipeline_engine.py) or the plain one
        base = type(model.verify_view()) if hasattr(model, "verify_view") else EngineView
        view = type("_View", (base,), {"checkpointer": lambda self: checkpointer(self.module)})
        model.verify_view = lambda: view(model)
        return model

    engine.__doc__ = checkpointer.__doc__
    return engine


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (the tensor itself otherwise), to change in place."""
    return t._local_tensor if isinstance(t, DTensor) else t
