"""Single-process reference trainer. Kept short and plain so it can be checked by eye: it shares
the model, data and optimizer choice with the sharded side, and nothing of its sharding path.

`emulate=True` (the default) reproduces the sharded arithmetic without any process group: every
data-parallel rank's micro-batch is run separately, with parameters and inputs cast as FSDP2's
MixedPrecisionPolicy casts them, gradients in `param_dtype`, upcast to `reduce_dtype`, summed over
ranks in rank order and divided by the world size (ReduceOp.AVG), then accumulated into fp32
master gradients. `emulate=False` runs each micro-batch of the global batch in one piece (one
virtual rank): numerically equivalent, differently rounded; it calibrates the noise floor.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from verify.case import Case
from verify.data import global_batch, microbatch_slices
from verify.models import build_model, loss_fn
from verify.optim import make_optimizer, optimizer_state
from verify.precision import cast_floats, to_dtype
from verify.rng import dropout_seed
from verify.trace import Trace


def train_reference(case: Case, emulate: bool = True, reverse: bool = False) -> Trace:
    """`reverse=True` sums ranks and gradient norms in reverse order: a calibration run."""
    model = build_model(case.model, case.seed, init="eager")
    _install_precision_hooks(model, case)
    params = dict(model.named_parameters())  # tied weights appear once
    optimizer = make_optimizer(case.optim, params.values())
    trace = Trace("reference", meta={"case": case.hash, "emulate": emulate, "reverse": reverse})
    _record_params(trace, 0, params, initial=True)

    param_dtype = to_dtype(case.precision.param_dtype) or torch.float32
    reduce_dtype = to_dtype(case.precision.reduce_dtype) or param_dtype
    # Each data-parallel rank draws dropout masks from its own generator; replay every stream.
    rng_states = [torch.manual_seed(dropout_seed(case, r)).get_state() for r in range(case.world_size)]
    for step in range(1, case.steps + 1):
        inputs, targets = global_batch(case, step)
        # groups[m] = the per-rank sample slices of micro-batch m (one virtual rank if not emulating)
        per_rank = [microbatch_slices(case, r) for r in range(case.world_size)]
        groups = [[ranks[m] for ranks in per_rank] for m in range(case.microbatches)]
        if not emulate:
            groups = [[torch.cat([torch.arange(s.start, s.stop) for s in g])] for g in groups]
        logits: dict[int, torch.Tensor] = {}
        loss_sum = torch.zeros((), dtype=torch.float32)
        master_grads: dict[str, torch.Tensor] = {}
        local_grads: list[dict[str, torch.Tensor]] = [{} for _ in groups[0]]  # sync-last accumulators
        for m, group in enumerate(groups):
            rank_grads = []
            for r, index in enumerate(group):
                torch.set_rng_state(rng_states[r])
                compute = {n: p.detach().to(param_dtype).requires_grad_(p.requires_grad) for n, p in params.items()}
                out = functional_call(model, compute, (inputs[index],))
                loss = loss_fn(case.model, out, targets[index]) / case.microbatches
                trainable = [n for n in compute if compute[n].requires_grad]
                grads = torch.autograd.grad(loss, [compute[n] for n in trainable])
                rank_grads.append(dict(zip(trainable, grads)))
                rng_states[r] = torch.get_rng_state()
                loss_sum += loss.detach().float() / len(group)
                _store_logits(logits, index, out.detach())
            if not case.sync_every_microbatch:
                for acc, g in zip(local_grads, rank_grads):  # unsharded accumulation in param_dtype
                    for n, t in g.items():
                        acc[n] = acc[n] + t if n in acc else t
                if m < len(groups) - 1:
                    continue
                rank_grads = local_grads
            for n in rank_grads[0]:
                ordered = [g[n] for g in rank_grads]
                reduced = _average(ordered[::-1] if reverse else ordered, reduce_dtype).to(torch.float32)
                master_grads[n] = master_grads[n] + reduced if n in master_grads else reduced
        for n, p in params.items():
            p.grad = master_grads.get(n)

        trace.add(step, "logits", "logits", torch.cat([logits[i] for i in sorted(logits)]))
        trace.add(step, "loss", "loss", loss_sum)
        for n, g in master_grads.items():
            trace.add(step, "grads", n, g)
        if case.clip_norm is not None:
            with_grad = [p for p in params.values() if p.grad is not None]
            norm = torch.nn.utils.clip_grad_norm_(with_grad[::-1] if reverse else with_grad, case.clip_norm)
            trace.add(step, "grad_norm", "total_norm", norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _record_params(trace, step, params)
        for key, value in optimizer_state(optimizer, params).items():
            trace.add(step, "optim_state", key, value)
    return trace


def _average(grads: list[torch.Tensor], reduce_dtype: torch.dtype) -> torch.Tensor:
    """ReduceOp.AVG as FSDP2 issues it: upcast, sum in rank order, divide by the world size."""
    total = grads[0].to(reduce_dtype)
    for g in grads[1:]:
        total = total + g.to(reduce_dtype)
    return total / len(grads) if len(grads) > 1 else total


def _store_logits(logits: dict[int, torch.Tensor], index, out: torch.Tensor) -> None:
    rows = range(index.start, index.stop) if isinstance(index, slice) else index.tolist()
    for i, row in zip(rows, out):
        logits[i] = row.unsqueeze(0)


def _record_params(trace: Trace, step: int, params: dict[str, nn.Parameter], initial: bool = False) -> None:
    total = torch.zeros((), dtype=torch.float64)
    for n, p in params.items():
        if initial:
            trace.add(0, "init", n, p)
        else:
            trace.add(step, "params", n, p)
        s = p.detach().double().sum()
        trace.add(step, "param_sums", n, s)
        total += s
    trace.add(step, "param_sums", "__total__", total)


def _install_precision_hooks(model: nn.Module, case: Case) -> None:
    """FSDP2 casts floating inputs of every shard unit to `param_dtype` (cast_forward_inputs) and
    its outputs to `output_dtype`; the same casts, on the same modules."""
    policy = case.precision
    param_dtype, output_dtype = to_dtype(policy.param_dtype), to_dtype(policy.output_dtype)
    for fqn in case.wrap_plan:
        module = model.get_submodule(fqn)
        if policy.cast_forward_inputs and param_dtype is not None:
            module.register_forward_pre_hook(
                lambda _m, args, kw, d=param_dtype: (cast_floats(args, d), cast_floats(kw, d)), with_kwargs=True
            )
        if output_dtype is not None:
            module.register_forward_hook(lambda _m, _a, out, d=output_dtype: cast_floats(out, d))
