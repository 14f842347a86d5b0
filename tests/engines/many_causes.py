"""A faulty engine with several distinct causes of failure, picked by what a case draws (all
visible in a report's case row, so a test can tell which cause each failing case should have):

- bf16 parameters: FSDP2 whose gradients are divided by the world size twice (a divergence at the
  gradients, 1/2 or 1/3 off by the world size);
- fp32 at world size 3: rank 0 raises while sharding, its message naming numbers that vary;
- fp32 at world size 2 and two steps or more: rank 1 exits in its second forward (a crash);
- fp32 at world size 2 and one step: plain FSDP2, which passes.

A sweep over it is the many-failures report of issue 38: a handful of causes behind many cases."""

import os

import torch
import torch.distributed as dist

from fsdp_verify.engines.fsdp2 import fully_shard_engine
from fsdp_verify.zoo.mutants import grads_divided_twice


def shard(model, mesh, spec):
    case = spec.case
    if spec.mp_policy.param_dtype == torch.bfloat16:
        return grads_divided_twice(model, mesh, spec)
    if mesh.size() == 3 and dist.get_rank() == 0:
        raise RuntimeError(
            f"engine bug: {len(spec.wrap)} units over {sum(p.numel() for p in model.parameters())} values"
        )
    if mesh.size() == 2 and case.steps >= 2 and dist.get_rank() == 1:
        forwards = []

        def exit_in_the_second_forward(*_):
            forwards.append(1)
            if len(forwards) == 2:
                os._exit(7)

        model.register_forward_pre_hook(exit_in_the_second_forward)
    return fully_shard_engine(model, mesh, spec)


def expected_cause(row: dict) -> str | None:
    """Which of the causes above a case row should show (None: it should pass)."""
    if row["precision"] == "bf16":
        return "gradients divided twice"
    if row["world_size"] == 3:
        return "raises while sharding"
    return "crash in the second forward" if row["steps"] >= 2 else None


# Built on the built-in engine: drawn what it is drawn (verify/engines/capabilities.py).
shard.capabilities = fully_shard_engine.capabilities
