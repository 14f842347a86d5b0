"""`--engine fsdp1`: PyTorch FSDP1, `FullyShardedDataParallel`, with its FlatParameter.

Each module of the wrap plan becomes an FSDP1 instance, children first and the root last, so a
parent's FlatParameter takes only the parameters its wrapped children did not. The Case maps onto
FSDP1 like this:

* `use_orig_params=True`: the optimizer steps the original parameters by their FQNs; between
  iterations each is a 1-D view of its slice of the local FlatParameter shard (size 0 on a rank
  that holds none of it), and its gradient likewise (None there).
* `reshard_after_forward`: True (or an int) -> FULL_SHARD, False -> SHARD_GRAD_OP.
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


def fsdp1_engine(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    if spec.mp_policy.output_dtype is not None:
        raise ValueError("precision.output_dtype: FSDP1 has no output_dtype; expected null")
    if mesh.ndim != 1:
        raise ValueError(f"mesh_shape: the fsdp1 engine shards on one mesh dimension, got {tuple(mesh.shape)}")
    # An int (FSDP2: reshard to a smaller group after forward) is a memory/communication trade
    # FSDP1 lacks; numerically it is resharding after forward, so it maps to FULL_SHARD.
    rsf = spec.reshard_after_forward is not False
    policy = spec.mp_policy
    options = dict(
        process_group=mesh.get_group(0),
        sharding_strategy=ShardingStrategy.FULL_SHARD if rsf else ShardingStrategy.SHARD_GRAD_OP,
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
        # Expected at world size 1, once per unit: README "FSDP1" documents what NO_SHARD changes.
        warnings.filterwarnings("ignore", message="FSDP is switching to use `NO_SHARD`")
        for fqn in spec.wrap:
            if fqn == "":
                model = FSDP1Root(model, **options)
            else:
                parent, _, name = fqn.rpartition(".")
                owner = model.get_submodule(parent)
                setattr(owner, name, FSDP(owner.get_submodule(name), **options))
    if not isinstance(model, FSDP):  # the plan always ends with the root; be explicit anyway
        raise ValueError(f"wrap: the fsdp1 engine needs the root '' last, got {spec.wrap!r}")
    return model


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
)
fsdp1_engine.contracts = Contracts(
    comm=False, memory=False, why="FSDP1 gathers one aligned, padded FlatParameter per unit: not FSDP2's model"
)
# One process group (FULL_SHARD / SHARD_GRAD_OP): a 1-D mesh only; no output_dtype; an int
# reshard_after_forward is FULL_SHARD whatever it divides. Refused before any rank starts.
fsdp1_engine.capabilities = Capabilities(mesh_dims=(1,), output_dtype=False, reshard_int_divides_shard=False)


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
        super().__init__(root, root.process_group)
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

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """FSDP1's own: local norms of the sharded grads, all-reduced, sqrt (a collective)."""
        with warnings.catch_warnings():
            # A rank whose shards hold no gradient (a tiny model over 4 ranks) is expected here.
            warnings.filterwarnings("ignore", message=r"Called FSDP.clip_grad_norm_\(\) on rank")
            return self.root.clip_grad_norm_(max_norm)

    def set_requires_gradient_sync(self, sync: bool) -> None:
        for _, fsdp in self.units:  # what the `no_sync()` context manager sets and restores
            fsdp._sync_gradients = sync
