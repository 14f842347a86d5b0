"""`--engine fsdp1`: PyTorch FSDP1, `FullyShardedDataParallel`, with its FlatParameter.

Each module of the wrap plan becomes an FSDP1 instance, children first and the root last, so a
parent's FlatParameter takes only the parameters its wrapped children did not. The Case maps onto
FSDP1 like this:

* `use_orig_params=True`: the optimizer steps the original parameters by their FQNs; between
  iterations each is a 1-D view of its slice of the local FlatParameter shard (size 0 on a rank
  that holds none of it), and its gradient likewise (None there).
* `reshard_after_forward`: True (or an int) -> FULL_SHARD, False -> SHARD_GRAD_OP.
* `mesh_shape` (replicate R, shard S), mesh dims ("replicate", "shard"):
  - (W,) or (1, W): FULL_SHARD / SHARD_GRAD_OP over the shard group.
  - (R, S), both >= 2: HYBRID_SHARD / _HYBRID_SHARD_ZERO2 on the 2-D mesh (`device_mesh=`):
    each unit's padded flat gradient is reduce-scattered over its shard group (pre-divided by
    f, the power of two of the whole data-parallel world R * S) and the shard all-reduced over
    its replicate group, then post-divided by R * S / f. Its clip all-reduces the shards' norms
    over the shard group only (the replicas hold the same shards).
  - (W, 1), W >= 2: NO_SHARD over the replicate group (all W ranks): each rank keeps every
    parameter whole and all-reduces its flat gradient (pre/post-divided the same way): what a
    replicate-only mesh means, and what FSDP1 does with a shard group of one. Not HYBRID_SHARD
    on that mesh: FSDP1 switches a size-1 shard group to NO_SHARD *over that group* and then
    never all-reduces over the replicas, only divides by R (torch 2.13;
    tests/upstream/test_fsdp1_hybrid_shard_group_of_one.py), so the replicas drift apart.
    Its clip is torch's plain clip_grad_norm_ (no collective), as at world size 1.
* `MixedPrecisionPolicy` -> `MixedPrecision(param_dtype, reduce_dtype, cast_forward_inputs)`
  (also for the root: FSDP1 would otherwise cast the root's inputs whatever the policy says).
  FSDP1 casts the unsharded gradient (in `param_dtype`) to `reduce_dtype`, divides it by a
  pre-divide factor f, reduce-scatters with SUM, divides by world_size / f, and casts the shard
  back to fp32. f is a power of two, so the pre-divide is exact, and the post-divide of the
  exactly scaled sum rounds once to the same value as sum / world_size: bit for bit what the
  reference's upcast-sum-divide gives for the same summation order, except where a pre-divided
  value is subnormal or an undivided fp16 sum overflows (fp16 loss scaling): the reference
  divides as FSDP1 does (`Arithmetic.predivide="always"`).
  FSDP1 has no `output_dtype`: a Case asking for one is refused, not silently ignored.
* Gradient sync off (sync only on the last micro-batch) is what `no_sync()` does: the
  `_sync_gradients` flag of every FSDP instance; unsharded grads accumulate in `param_dtype`.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
from torch.distributed.fsdp._common_utils import clean_tensor_name

from fsdp_verify.engines.arithmetic import Arithmetic
from fsdp_verify.engines.capabilities import Capabilities
from fsdp_verify.engines.contracts import Contracts
from fsdp_verify.engines.flat.view import FlatView, Holding
from fsdp_verify.engines.spec import ShardSpec
from fsdp_verify.engines.view import EngineView


def fsdp1_engine(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    _refuse_what_fsdp1_lacks(spec)
    return wrap_fsdp1(model, mesh, spec, placement(mesh, spec.reshard_after_forward))


def _refuse_what_fsdp1_lacks(spec: ShardSpec) -> None:
    if spec.mp_policy.output_dtype is not None:
        raise ValueError("precision.output_dtype: FSDP1 has no output_dtype; expected null")


def wrap_fsdp1(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec, placed: dict) -> nn.Module:
    """Every unit of the plan an FSDP1 instance with the strategy and groups `placed` gives (the
    zoo's FSDP1 mutants place them otherwise)."""
    _refuse_what_fsdp1_lacks(spec)
    policy = spec.mp_policy
    options = dict(
        **placed,
        mixed_precision=MixedPrecision(
            param_dtype=policy.param_dtype,
            reduce_dtype=policy.reduce_dtype,
            cast_forward_inputs=policy.cast_forward_inputs,
            cast_root_forward_inputs=policy.cast_forward_inputs,  # FSDP2 has no root exception
        ),
        use_orig_params=True,
        device_id=next(model.parameters()).device,
    )
    with warnings.catch_warnings():
        # Expected at world size 1, once per unit: docs/engines.md "FSDP1" documents what NO_SHARD changes.
        warnings.filterwarnings("ignore", message="FSDP is switching to use `NO_SHARD`")
        warnings.filterwarnings("ignore", message="The `NO_SHARD` sharding strategy is deprecated")  # (W, 1)
        for fqn in spec.wrap:
            if fqn == "":
                model = FSDP1Root(model, **options)
            else:
                parent, _, name = fqn.rpartition(".")
                owner = model.get_submodule(parent)
                setattr(owner, name, FSDP(owner.get_submodule(name), **options))
    if not isinstance(model, FSDP):  # the plan always ends with the root; be explicit anyway
        raise ValueError(f"wrap: the fsdp1 engine needs the root '' last, got {spec.wrap!r}")
    # What the view gathers a FlatParameter's slices over: the shard group, of one rank under
    # NO_SHARD (every rank holds the whole parameter; its process group is the replicas').
    model.shard_group = mesh.get_group(mesh.ndim - 1)
    return model


def placement(mesh: DeviceMesh, reshard_after_forward: bool | int) -> dict:
    """The sharding strategy and its process groups for a (shard,) or (replicate, shard) mesh
    (the module docstring's table). An int (FSDP2: reshard to a smaller group after forward) is
    a memory/communication trade FSDP1 lacks; numerically it is resharding after forward."""
    if mesh.ndim not in (1, 2):
        raise ValueError(f"mesh_shape: the fsdp1 engine takes (shard,) or (replicate, shard), got {tuple(mesh.shape)}")
    rsf = reshard_after_forward is not False
    replicas, shards = (1, mesh.size(0)) if mesh.ndim == 1 else (mesh.size(0), mesh.size(1))
    if replicas > 1 and shards > 1:
        strategy = ShardingStrategy.HYBRID_SHARD if rsf else ShardingStrategy._HYBRID_SHARD_ZERO2
        return dict(device_mesh=mesh, sharding_strategy=strategy)
    if replicas > 1:
        return dict(process_group=mesh.get_group(0), sharding_strategy=ShardingStrategy.NO_SHARD)
    strategy = ShardingStrategy.FULL_SHARD if rsf else ShardingStrategy.SHARD_GRAD_OP
    return dict(process_group=mesh.get_group(mesh.ndim - 1), sharding_strategy=strategy)


# Its FlatParameter aligns each parameter to 16 bytes (use_orig_params), its clip lists the
# handles in module order, skips parameters a rank holds none of (and at world size 1, NO_SHARD,
# is torch's plain clip_grad_norm_), it has no unit-input node, and a unit without parameters of
# its own (all of them in wrapped children) does not cast its inputs.
fsdp1_engine.arithmetic = Arithmetic(
    layout="flat",
    align_bytes=16,
    unit_order="preorder",
    empty_pieces_in_norm=False,
    unit_input_node=False,
    casts_inputs_without_params=False,
    plain_norm_unsharded=True,
    predivide="always",
    no_shard_reduces_running_sum=True,
)
fsdp1_engine.contracts = Contracts(
    comm=False,
    memory=False,
    why="FSDP1 gathers one aligned, padded FlatParameter per unit, all-reduces its reduce-scattered"
    " shard over the replicas on a (replicate, shard) mesh, and under NO_SHARD ((W, 1)) all-reduces"
    " it whole with no all-gather: not FSDP2's model",
)
# One process group (FULL_SHARD / SHARD_GRAD_OP): a 1-D mesh only; no output_dtype; an int
# reshard_after_forward is FULL_SHARD whatever it divides. Refused before any rank starts.
# 2-D meshes: HYBRID_SHARD / _HYBRID_SHARD_ZERO2 on (R, S), NO_SHARD on (W, 1) (the module's docstring).
# None of fully_shard's knobs (one FlatParameter per unit, no per-parameter placement); of the
# loop's settings only unfreezing (FSDP1 has no set_requires_all_reduce / set_reshard_after_backward).
fsdp1_engine.capabilities = Capabilities(
    mesh_dims=(1, 2),
    takes=("experts",),
    module_takes=("unfreeze_step",),
    output_dtype=False,
    reshard_int_divides_shard=False,
)


class FSDP1Root(FSDP):
    """The root FSDP1 instance, with the view the loop reads it through. Its parameter and
    buffer names are the original ones (FSDP1 itself cleans the `_fsdp_wrapped_module.` prefixes
    only inside `summon_full_params`), so probes can match them with the reference's."""

    def named_parameters(self, *args, **kwargs):
        for name, p in super().named_parameters(*args, **kwargs):
            yield clean_tensor_name(name), p

    def named_buffers(self, *args, **kwargs):
        for name, b in super().named_buffers(*args, **kwargs):
            yield clean_tensor_name(name), b

    def verify_view(self) -> FSDP1View:
        return FSDP1View(self)


class FSDP1View(FlatView):
    def __init__(self, root: FSDP):
        super().__init__(root, root.shard_group)
        self.root = root
        self.units = [(clean_tensor_name(name), m) for name, m in root.named_modules() if isinstance(m, FSDP)]

    def holdings(self) -> list[Holding]:
        """From each FlatParameter's own metadata: its FQNs (relative to the wrapped module),
        shapes, and the original parameters, which between iterations are views of this rank's
        slices (use_orig_params=True)."""
        out = []
        for unit, fsdp in self.units:
            handle = fsdp._handle
            if handle is None:  # an instance whose params all belong to wrapped children
                continue
            flat = handle.flat_param
            for rel, shape, param in zip(flat._fqns, flat._shapes, flat._params):
                out.append(Holding(clean_tensor_name(f"{unit}.{rel}" if unit else rel), unit, tuple(shape), param))
        return out

    def checkpointer(self):
        """FSDP1's own sharded state dict (ShardedTensors), through `get_state_dict`, not a flat
        piece engine's whole tensors."""
        return EngineView.checkpointer(self)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """FSDP1's own: local norms of the sharded grads, all-reduced, sqrt (a collective)."""
        with warnings.catch_warnings():
            # A rank whose shards hold no gradient (a tiny model over 4 ranks) is expected here.
            warnings.filterwarnings("ignore", message=r"Called FSDP.clip_grad_norm_\(\) on rank")
            return self.root.clip_grad_norm_(max_norm)

    def set_requires_gradient_sync(self, sync: bool) -> None:
        for _, fsdp in self.units:  # what the `no_sync()` context manager sets and restores
            fsdp._sync_gradients = sync
