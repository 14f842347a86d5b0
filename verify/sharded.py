"""The sharded side of a comparison: the toolkit's training loop around an engine, on one rank.

Runs identically in a pool worker and in place under torchrun. Every rank takes part in every
gather; rank 0 alone keeps the Trace. `phase` is called before each stage so that a crash or hang
can be reported by rank and phase.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from verify.case import Case
from verify.data import global_batch, microbatch_slices
from verify.engines import ShardSpec, resolve_engine
from verify.gather import gather_full, sum_full
from verify.models import build_model, loss_fn
from verify.optim import make_optimizer, optimizer_state
from verify.rng import dropout_seed
from verify.trace import Trace


@dataclass
class RankContext:
    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh
    phase: Callable[[str], None] = lambda _p: None


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor from a DTensor shard (a collective: every rank must call it)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run_sharded(case: Case, ctx: RankContext) -> Trace | None:
    ctx.phase("build model")
    model = build_model(case.model, case.seed, case.init, device=ctx.device)
    ctx.phase("shard (engine)")
    engine = resolve_engine(case.engine)
    sharded = engine(model, ctx.mesh, ShardSpec.from_case(case))
    params = dict(sharded.named_parameters())
    optimizer = make_optimizer(case.optim, params.values())
    trace = Trace("sharded", meta={"case": case.hash, "engine": case.engine}) if ctx.rank == 0 else None

    ctx.phase("step 0 gather initial params")
    _record_params(trace, 0, params, initial=True)
    torch.manual_seed(dropout_seed(case, ctx.rank))
    dtypes: dict[str, str] = {}
    for step in range(1, case.steps + 1):
        inputs, targets = global_batch(case, step)
        logits, local_loss = [], torch.zeros((), dtype=torch.float32, device=ctx.device)
        slices = microbatch_slices(case, ctx.rank)
        for m, index in enumerate(slices):
            if hasattr(sharded, "set_requires_gradient_sync") and not case.sync_every_microbatch:
                sharded.set_requires_gradient_sync(m == len(slices) - 1)
            ctx.phase(f"step {step} forward (micro-batch {m})")
            out = sharded(inputs[index].to(ctx.device))
            loss = loss_fn(case.model, out, targets[index].to(ctx.device)) / case.microbatches
            ctx.phase(f"step {step} backward (micro-batch {m})")
            loss.backward()
            logits.append(out.detach())
            local_loss += loss.detach().float()
        dtypes["logits"] = str(out.dtype)

        ctx.phase(f"step {step} gather logits and loss")
        _add(trace, step, "logits", "logits", _all_gather_rows(torch.cat(logits)))
        dist.all_reduce(local_loss)
        _add(trace, step, "loss", "loss", local_loss / ctx.world_size)

        ctx.phase(f"step {step} gather gradients")
        with_grad = {n: p.grad for n, p in params.items() if p.grad is not None}
        for (name, g), whole in zip(with_grad.items(), gather_full(list(with_grad.values()))):
            dtypes["grads"] = str(g.dtype)
            _add(trace, step, "grads", name, whole)
        if case.clip_norm is not None:
            ctx.phase(f"step {step} clip gradients")
            grads_of = [p for p in params.values() if p.grad is not None]
            norm = torch.nn.utils.clip_grad_norm_(grads_of, case.clip_norm)
            _add(trace, step, "grad_norm", "total_norm", full(norm))
        ctx.phase(f"step {step} optimizer step")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ctx.phase(f"step {step} gather params and optimizer state")
        _record_params(trace, step, params)
        state = optimizer_state(optimizer, params)
        for key, whole in zip(state, gather_full(list(state.values()))):
            _add(trace, step, "optim_state", key, whole)
    ctx.phase("done")
    if trace is not None:
        trace.meta["dtypes"] = dtypes
    return trace


def _add(trace: Trace | None, step: int, phase: str, name: str, value: torch.Tensor) -> None:
    if trace is not None:
        trace.add(step, phase, name, value)


def _record_params(trace: Trace | None, step: int, params: dict[str, torch.Tensor], initial: bool = False) -> None:
    """Full params, and per-param sums computed from the local shards (sum of each shard, then
    reduced): a second path that sees padding leaking into shards or a parameter held twice."""
    tensors = [p.detach() for p in params.values()]
    sums = sum_full(tensors)
    for name, whole, s in zip(params, gather_full(tensors), sums):
        _add(trace, step, "init" if initial else "params", name, whole)
        _add(trace, step, "param_sums", name, s)
    _add(
        trace,
        step,
        "param_sums",
        "__total__",
        torch.stack(sums).sum() if sums else torch.zeros((), dtype=torch.float64),
    )


def _all_gather_rows(local: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's rows in rank order (= global sample order). Sent as fp32, which
    holds bf16 and fp16 values exactly, since not every backend reduces low-precision types."""
    world = dist.get_world_size()
    if world == 1:
        return local
    wide = local.to(torch.float32)
    parts = [torch.empty_like(wide) for _ in range(world)]
    dist.all_gather(parts, wide)
    return torch.cat(parts).to(local.dtype)
