"""Engines that break in ways the pool and the comparators must notice (loaded by file path,
which also exercises the `path/to/file.py:NAME` engine contract)."""

import os
import socket
import time

import torch
import torch.distributed as dist

from fsdp_verify.engines.fsdp2 import fully_shard_engine
from fsdp_verify.units import modules_of


def rank1_activation_error(model, mesh, spec):
    """Rank 1 scales its first layer's output by (1 + 1e-5)."""
    if dist.get_rank() == 1:
        first = modules_of(model, spec.wrap[0])[0]
        first.register_forward_hook(lambda _m, _a, out: out * (1 + 1e-5))
    return fully_shard_engine(model, mesh, spec)


def rank1_reduced_grad_scaled(model, mesh, spec):
    """Rank 1 scales its shard of every reduced gradient by (1 + 1e-3), after the reduce-scatter:
    only rank 1's rows of the gradients differ (the step hints' rank-only case)."""
    fully_shard_engine(model, mesh, spec)
    if dist.get_rank() == 1:
        for unit in _units(model):
            unit.set_all_reduce_hook(lambda t: t.mul_(1 + 1e-3))
    return model


def one_unit_divided_twice(model, mesh, spec):
    """The first wrapped unit alone divides its reduced gradients by the world size once more:
    those gradients are 1/W of the reference's, the others right (no whole-step factor)."""
    fully_shard_engine(model, mesh, spec)
    world = mesh.size()
    modules_of(model, spec.wrap[0])[0].set_all_reduce_hook(lambda t: t.div_(world))  # the unit's state
    return model


def _units(model):
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def rank1_crashes_in_forward(model, mesh, spec):
    if dist.get_rank() == 1:
        model.register_forward_pre_hook(lambda *_: os._exit(7))
    return fully_shard_engine(model, mesh, spec)


def rank1_segfaults_in_forward(model, mesh, spec):
    """A native crash, as a library's segfault is: SIGSEGV, nothing Python can catch."""
    if dist.get_rank() == 1:
        import ctypes

        model.register_forward_pre_hook(lambda *_: ctypes.string_at(0))
    return fully_shard_engine(model, mesh, spec)


def rank1_hangs_in_forward(model, mesh, spec):
    if dist.get_rank() == 1:
        model.register_forward_pre_hook(lambda *_: time.sleep(3600))
    return fully_shard_engine(model, mesh, spec)


def rank0_raises_while_sharding(model, mesh, spec):
    if dist.get_rank() == 0:
        raise RuntimeError("engine bug on rank 0")
    return fully_shard_engine(model, mesh, spec)


def rank1_skips_a_collective(model, mesh, spec):
    """Rank 0 runs an extra all-reduce the other rank never joins."""
    if dist.get_rank() == 0:
        model.register_forward_pre_hook(lambda *_: dist.all_reduce(torch.ones(1)))
    return fully_shard_engine(model, mesh, spec)


def rank1_drops_its_connections_then_dies(model, mesh, spec):
    """Rank 1 shuts its sockets (its peers' collectives fail at once, "Connection closed by
    peer") and exits a second later: the peers' errors reach the pool before rank 1's death."""
    if dist.get_rank() == 1:

        def drop_then_die(*_):
            for fd in os.listdir("/proc/self/fd"):
                try:
                    if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                        socket.socket(fileno=os.dup(int(fd))).shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            time.sleep(1.0)
            os._exit(7)

        model.register_forward_pre_hook(drop_then_die)
    return fully_shard_engine(model, mesh, spec)


def ranks_all_reduce_different_sizes(model, mesh, spec):
    """Every rank all-reduces a tensor of its own size before each forward: gloo aborts the
    process ("Received data size doesn't match expected size"), a collective mismatch."""
    size = 1000 * (1 + dist.get_rank())  # large enough for gloo's checked path (a tiny one hangs)
    model.register_forward_pre_hook(lambda *_: dist.all_reduce(torch.ones(size)))
    return fully_shard_engine(model, mesh, spec)


def rank1_aborts_with_bf16_params(model, mesh, spec):
    """FSDP2, but rank 1 aborts (SIGABRT, as a failed C++ check does) in the first forward of a
    case with bf16 parameters: a crash on some draws only, so a search shrinks through crash after
    crash (the fail-fast measurements of issue 38)."""
    if dist.get_rank() == 1 and spec.mp_policy.param_dtype == torch.bfloat16:
        model.register_forward_pre_hook(lambda *_: os.abort())
    return fully_shard_engine(model, mesh, spec)
