"""Engines that break the precision contract in ways the numbers may not show (for
tests/test_precision_audit.py)."""

from __future__ import annotations

from dataclasses import replace

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_verify.engines.fsdp2 import fully_shard_engine
from fsdp_verify.engines.spec import ShardSpec


def output_dtype_ignored(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Drops `output_dtype` from the policy: unit outputs stay in the compute dtype."""
    p = spec.mp_policy
    policy = MixedPrecisionPolicy(p.param_dtype, p.reduce_dtype, None, p.cast_forward_inputs)
    return fully_shard_engine(model, mesh, replace(spec, mp_policy=policy))
