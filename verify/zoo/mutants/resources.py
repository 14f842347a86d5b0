"""The resource contracts (issue 14): every number right, the reason for sharding defeated:
gradients all-reduced in full, parameters gathered in fp32, the unsharded weights kept alive.
Only the communication and memory contracts can catch them."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_verify.engines.fsdp2 import fully_shard_engine
from fsdp_verify.engines.spec import ShardSpec
from fsdp_verify.torch_support import ZOO_COMM, private_name
from fsdp_verify.zoo.mutants._shared import _units
from fsdp_verify.zoo.pins import CHEAP
from fsdp_verify.zoo.registry import registrar

bug = registrar(__name__)


# FSDP2's default collectives are private: a release without them has no comm mutants (the zoo
# leaves them out, saying why: torch_support.ZOO_COMM); the rest of the zoo imports as ever.
_COLLECTIVES = "torch.distributed.fsdp._fully_shard._fsdp_collectives"
_DefaultReduceScatter = private_name(_COLLECTIVES, "DefaultReduceScatter") or object
_DefaultAllGather = private_name(_COLLECTIVES, "DefaultAllGather") or object


def _need_default_collectives() -> None:
    from fsdp_verify.torch_support import ZOO_COMM, part_off_note

    why = part_off_note(ZOO_COMM)
    if why:
        raise RuntimeError(why)


class _AllReduceThenKeepMine(_DefaultReduceScatter):
    """A "reduce-scatter" that all-reduces the whole gradient buffer and keeps this rank's chunk:
    the same sums (at two ranks bit for bit: a + b is b + a), twice the bytes on the wire."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        dist.all_reduce(input_tensor, op=op, group=group)
        output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])
        return None


@bug(
    "gradients all-reduced in full, each rank keeping its shard: the right sums at twice the bytes",
    "seed 001: per step a reduce-scatter of the gradients, not an all-reduce (DDP habits in FSDP)",
    ("comm",),
    # At two ranks an all-reduce adds in the reduce-scatter's order (a + b = b + a): the numbers
    # are bit for bit the correct engine's, so only the contract can tell.
    world_sizes=(2,),
    pins=dict(CHEAP),
    needs=(ZOO_COMM,),
)
def all_reduce_instead_of_reduce_scatter(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Gradients all-reduced in full, then each rank keeps its shard (DDP habits in a sharded
    engine; seed 001: a reduce-scatter moves half of an all-reduce's bytes)."""
    _need_default_collectives()
    fully_shard_engine(model, mesh, spec)
    for unit in _units(model):
        if unit._get_fsdp_state()._fsdp_param_groups:
            unit.set_custom_reduce_scatter(_AllReduceThenKeepMine())
    return model


class _GatherMasterWeights(_DefaultAllGather):
    """Gathers the fp32 master shards and casts to the compute dtype after gathering: the values
    the policy's bf16 all-gather gives (bf16 -> fp32 -> bf16 is exact), at twice the bytes."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        if output_tensor.dtype == torch.float32:
            return super().__call__(output_tensor, input_tensor, group, async_op)
        wide = torch.empty(output_tensor.shape, dtype=torch.float32, device=output_tensor.device)
        dist.all_gather_single(wide, input_tensor.float(), group=group)
        output_tensor.copy_(wide)
        return None


@bug(
    "parameters all-gathered in fp32 under a bf16 policy, cast to bf16 after the gather",
    "seed 001: the all-gather moves param_dtype (7B model, 4 ranks: 14 GB, not 28 GB, per gather)",
    ("comm",),
    precisions=("bf16",),
    pins=dict(CHEAP),
    needs=(ZOO_COMM,),
)
def all_gather_in_fp32(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Parameters all-gathered in fp32 under a bf16 policy, cast to bf16 after the gather
    (seed 001: the all-gather moves param_dtype, half an fp32 gather's bytes)."""
    _need_default_collectives()
    fully_shard_engine(model, mesh, spec)
    for unit in _units(model):
        if unit._get_fsdp_state()._fsdp_param_groups:
            unit.set_custom_all_gather(_GatherMasterWeights())
    return model


@bug(
    "the unsharded parameters kept alive after sharding: a full replica on every rank",
    "seeds 003/004: 1/N of the weights per rank (3.9x less at 8 ranks), unsharded only while computing",
    ("memory",),
    world_sizes=(1, 2, 3, 4),
    pins=dict(CHEAP),
)
def retains_full_params(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Keeps the model's original, unsharded parameters alive after sharding (a list kept for a
    state-dict fallback): every rank holds a full replica besides its shards (seeds 003/004)."""
    originals = list(model.parameters())
    fully_shard_engine(model, mesh, spec)
    model._pre_shard_params = originals  # type: ignore[attr-defined]
    return model
