"""Deliberately broken engines, written against the plug-in contract. Each is a small mutation
of the correct FSDP2 engine modelled on a real bug report; the toolkit's own tests (and the
self-test) require every one of them to be caught, by the right comparator, at the right place.
Use as `--engine fsdp_verify.zoo.mutants:NAME`."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from fsdp_verify.engines.capabilities import Capabilities
from fsdp_verify.engines.contracts import Contracts
from fsdp_verify.engines.expert_parallel import ExpertParallel, apply_expert_parallel
from fsdp_verify.engines.fsdp1 import fsdp1_engine, placement, wrap_fsdp1
from fsdp_verify.engines.fsdp2 import fully_shard_engine
from fsdp_verify.engines.prefetch import set_prefetching
from fsdp_verify.engines.spec import ShardSpec
from fsdp_verify.engines.view import EngineView
from fsdp_verify.models.moe import moe_layers
from fsdp_verify.torch_support import private_name
from fsdp_verify.training.checkpointing import checkpoint_units
from fsdp_verify.training.resume import Checkpointer, saved_template, trainer_template
from fsdp_verify.units import members, modules_of


def _units(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def grads_divided_twice(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Averages over ranks, then divides by the world size once more (a manual `/ world_size`
    on top of ReduceOp.AVG)."""
    fully_shard_engine(model, mesh, spec)
    world = mesh.size()
    for unit in _units(model):
        unit.set_all_reduce_hook(lambda t: t.div_(world))
    return model


def group_sharded_module_by_module(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """A unit over several modules ("norm+output") sharded as one unit a module: `fully_shard`
    called on each member, the group's one all-gather and reduce-scatter become one a module
    (an engine that walks a framework's plan module by module)."""
    split = replace(spec, wrap=tuple(m for unit in spec.wrap for m in members(unit)))
    return fully_shard_engine(model, mesh, split)


def grad_sync_off_for_one_unit(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Leaves gradient sync off for the first wrapped module (a `no_sync` that never ended)."""
    fully_shard_engine(model, mesh, spec)
    modules_of(model, spec.wrap[0])[0].set_requires_gradient_sync(False, recurse=False)  # the unit's state
    return model


def rank1_different_init(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Rank 1 re-initialises before sharding and nothing syncs module states (no broadcast from
    rank 0), so its shards hold other values."""
    if dist.get_rank() == 1:
        generator = torch.Generator().manual_seed(12345)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02, generator=generator)
    return fully_shard_engine(model, mesh, spec)


def inputs_cast_to_bf16(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Casts floating inputs to bf16 (and back) although the policy is full precision."""

    def cast(_module, args):
        return tuple(a.to(torch.bfloat16).to(a.dtype) if torch.is_floating_point(a) else a for a in args)

    model.register_forward_pre_hook(cast)
    return fully_shard_engine(model, mesh, spec)


def master_weights_in_bf16(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """`model.to(torch.bfloat16)` before sharding: the sharded master weights, their gradients and
    the optimizer state all become bf16 (seed 000/001: master weights must stay fp32)."""
    return fully_shard_engine(model.to(torch.bfloat16), mesh, spec)


def grads_not_averaged(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Sums gradients over ranks instead of averaging them (a gradient divide factor of 1, as
    when a custom reduce op or loss scaling forgets the `/ world_size`). SUM reduction is forced
    because gloo has no PREMUL_SUM."""
    fully_shard_engine(model, mesh, spec)
    for unit in _units(model):
        unit.set_force_sum_reduction_for_comms(True)
        unit.set_gradient_divide_factor(1.0)
    return model


def _with_policy(spec: ShardSpec, **changes) -> ShardSpec:
    policy = spec.mp_policy
    fields = {f: getattr(policy, f) for f in ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")}
    return replace(spec, mp_policy=MixedPrecisionPolicy(**{**fields, **changes}))


def reduce_in_bf16(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Drops `reduce_dtype` when building the policy, so gradients are reduce-scattered in
    `param_dtype` (bf16) although the case asks for fp32 (seed 000: bf16 reductions lose the small
    contributions that survive cancellation)."""
    return fully_shard_engine(model, mesh, _with_policy(spec, reduce_dtype=None))


def param_dtype_ignored(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Drops `param_dtype`: forward and backward run in fp32 although the case asks for bf16 (the
    numbers can be close enough to pass; the precision contract is not)."""
    return fully_shard_engine(model, mesh, _with_policy(spec, param_dtype=None))


def microbatch_accumulation_overwrites(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Every micro-batch's forward drops the gradient accumulated so far (a `zero_grad` inside
    the accumulation loop; `grad = new` for `grad += new`): only the last micro-batch counts."""
    fully_shard_engine(model, mesh, spec)
    sharded = list(model.parameters())  # in forward, a unit's module holds unsharded params instead

    def drop_grads(_module, _args):
        for p in sharded:
            p.grad = None

    model.register_forward_pre_hook(drop_grads)
    return model


class _NoSyncView(EngineView):
    def set_requires_gradient_sync(self, sync: bool) -> None:
        self.module.set_requires_gradient_sync(False)


def grad_sync_off_on_last_microbatch(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Accumulating without communication, it never turns gradient sync back on for the last
    micro-batch (a `no_sync` that also wraps the final backward): no gradient is ever reduced."""
    fully_shard_engine(model, mesh, spec)
    model.verify_view = lambda: _NoSyncView(model)
    return model


class _LocalNormView(EngineView):
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        local = [p.grad.to_local() for p in self.parameters().values() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(local, max_norm)


def clip_with_local_norm(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Clips each rank's shards by that rank's own norm (`clip_grad_norm_` on the local tensors),
    not the global one (seed 001: local norms 2.236, 5, 7.81, 10.63; the global one is 14.283)."""
    fully_shard_engine(model, mesh, spec)
    model.verify_view = lambda: _LocalNormView(model)
    return model


# ---- ownership, RNG and shared state (tests/test_ownership.py, test_rng.py, test_shared_state.py) ----
def tie_broken_by_sharding(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Re-registers every module's parameters one by one before sharding with no memo of the
    ones already seen (`for m in modules: setattr(m, n, Parameter(p.clone()))`): the output head
    tied to the embedding gets its own copy, and the two train apart."""
    seen: set[int] = set()
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) in seen:
                setattr(module, name, nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
            seen.add(id(p))
    return fully_shard_engine(model, mesh, spec)


def frozen_params_move(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Loses `requires_grad=False` when sharding (a flat parameter that mixes frozen and trainable
    weights and requires grad as a whole, FSDP1 `use_orig_params=False` style): frozen weights get
    gradients and the optimizer moves them."""
    fully_shard_engine(model, mesh, spec)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def same_dropout_mask_on_every_rank(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Seeds the global generator from the run's seed at every forward "for reproducibility",
    without offsetting by rank: every rank draws the same dropout mask, so data-parallel ranks are
    no longer independent samples."""
    seed = spec.case.seed if spec.case is not None else 0

    def reseed(_module, _args) -> None:
        torch.manual_seed(seed)

    model.register_forward_pre_hook(reseed)
    return fully_shard_engine(model, mesh, spec)


def checkpoint_without_rng_state(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Activation checkpointing on every unit with `preserve_rng_state=False` ("it is faster"):
    the recomputation in backward draws new dropout masks, so the gradients belong to a forward
    that never ran, and each rank's generator ends the step further on than it should."""
    checkpoint_units(model, spec.case.wrap_plan if spec.case is not None else (), preserve_rng_state=False)
    return fully_shard_engine(model, mesh, spec)


def buffer_uninitialised_off_rank0(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Materialises on every rank but initialises only on rank 0 and broadcasts the parameters
    (sync_module_states-style): a non-persistent buffer (the Transformer's RoPE `freqs`) is neither
    a parameter nor in the state dict, so ranks other than 0 keep uninitialised (here zeroed) memory."""
    if dist.get_rank() != 0:
        with torch.no_grad():
            for b in model.buffers():
                b.zero_()
    return fully_shard_engine(model, mesh, spec)


class _StaleView(EngineView):
    def __init__(self, module: nn.Module, stale: dict[str, torch.Tensor]):
        super().__init__(module)
        self.stale = stale

    def parameters(self) -> dict[str, torch.Tensor]:
        return self.stale


def stale_optimizer_params(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Hands the trainer the parameters it collected before `fully_shard` replaced them with
    DTensors (an optimizer built from `model.parameters()` before sharding): the optimizer steps
    tensors the sharded model no longer computes with, and training does nothing."""
    stale = dict(model.named_parameters())
    fully_shard_engine(model, mesh, spec)
    model.verify_view = lambda: _StaleView(model, stale)
    return model


def meta_init_consumes_rng(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Re-initialises the way seed 004's engine did: seed the global generator, build the model on
    the meta device, materialise, then draw every initial value from the global generator. The
    meta build consumed random numbers (seed 004's model drew at construction; here one
    `torch.rand`) and the generator state was not saved and restored around it, so every initial
    value is shifted in the stream (seed 004, finding 3)."""
    torch.manual_seed(spec.case.seed if spec.case is not None else 0)
    torch.rand(1)  # what the meta-device build drew before initialisation
    model.init_weights(torch.default_generator)
    return fully_shard_engine(model, mesh, spec)


_FLAT_CONTRACTS = Contracts(comm=False, memory=False, why="the flat engine's FlatParameters: not FSDP2's model")
# As FSDP2 for meshes (what they were drawn with before), but no fully_shard knobs: the flat engine
# ignores them.
_FLAT_CAPABILITIES = Capabilities(takes=("experts",), module_takes=("unfreeze_step",))


# ---- the bundled flat engine's bugs (seed 004; tests/test_engine_flat.py) -------------------------
def _every_param_recursively(module: nn.Module):
    """`module.parameters(recurse=True)`, as (relative FQN, owner, attribute, parameter)."""
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for attr, p in owner.named_parameters(recurse=False):
            yield (f"{prefix}.{attr}" if prefix else attr), owner, attr, p


def flat_nested_double_ownership(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Seed 004's bug in the bundled flat engine: every unit flattens `parameters(recurse=True)`,
    so the root flattens each already wrapped layer's parameters a second time. They sit in two
    FlatParameters; the parameter sum after wrapping doubles."""
    from fsdp_verify.engines.flat.engine import flat_engine

    return flat_engine(model, mesh, spec, collect=_every_param_recursively)


flat_nested_double_ownership.contracts = _FLAT_CONTRACTS
flat_nested_double_ownership.capabilities = _FLAT_CAPABILITIES


def flat_meta_init_consumes_rng(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Seed 004 finding 3 in the flat engine's meta-device path: seeds the global generator, builds
    a throwaway eager copy to read shapes (its layers' default init draws from that generator),
    then builds on meta and initialises from the global generator without having saved and
    restored its state: every initial value comes from a later stretch of the random stream."""
    from fsdp_verify.engines.flat import materialize
    from fsdp_verify.engines.flat.engine import with_view, wrap_per_plan
    from fsdp_verify.models import _construct

    device = next(model.parameters()).device
    torch.manual_seed(spec.case.seed)
    _construct(spec.case.model)  # the bug: draws from the stream the init below relies on
    with torch.device("meta"):
        model = _construct(spec.case.model)
    wrap_per_plan(model, mesh, spec)
    return with_view(materialize(model, lambda m: m.init_weights(torch.default_generator), device))


flat_meta_init_consumes_rng.contracts = _FLAT_CONTRACTS
flat_meta_init_consumes_rng.capabilities = _FLAT_CAPABILITIES


class _ScaleGradOnce(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by `factor`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def rank1_grad_off_by_2e6_once(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """The smallest bug the toolkit promises to see in fp32: on rank 1 only, in the first
    backward only, every local gradient is 1 + 2e-6 times what it should be (logits and loss
    untouched), as a rank whose backward kernel rounded differently once would produce."""
    fully_shard_engine(model, mesh, spec)
    if dist.get_rank() != 1:
        return model
    calls = {"n": 0}

    def scale(_module, _args, out):
        calls["n"] += 1
        return _ScaleGradOnce.apply(out, 1 + 2e-6) if calls["n"] == 1 else out

    model.register_forward_hook(scale)
    return model


def loss_normalised_per_microbatch(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Each micro-batch's loss is the mean over its own real tokens, divided by the number of
    micro-batches (then ReduceOp.AVG): a mean of means, right only when every micro-batch holds
    as many real tokens (seed 000 asks for loss_sum * dp_size / global_batch_tokens)."""
    fully_shard_engine(model, mesh, spec)
    microbatches = spec.case.microbatches if spec.case is not None else 1
    model.loss_scale = lambda mb_items, rank_items, global_items, dp: 1.0 / (max(mb_items, 1) * microbatches)
    return model


def loss_normalised_per_rank(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Each rank divides its loss sum by its own real tokens (a per-rank mean, then ReduceOp.AVG):
    ranks with fewer tokens weigh each token more."""
    fully_shard_engine(model, mesh, spec)
    model.loss_scale = lambda mb_items, rank_items, global_items, dp: 1.0 / max(rank_items, 1)
    return model


# ---- resource contracts (issue 14): every number right, the reason for sharding defeated -------
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


def all_gather_in_fp32(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Parameters all-gathered in fp32 under a bf16 policy, cast to bf16 after the gather
    (seed 001: the all-gather moves param_dtype, half an fp32 gather's bytes)."""
    _need_default_collectives()
    fully_shard_engine(model, mesh, spec)
    for unit in _units(model):
        if unit._get_fsdp_state()._fsdp_param_groups:
            unit.set_custom_all_gather(_GatherMasterWeights())
    return model


def retains_full_params(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Keeps the model's original, unsharded parameters alive after sharding (a list kept for a
    state-dict fallback): every rank holds a full replica besides its shards (seeds 003/004)."""
    originals = list(model.parameters())
    fully_shard_engine(model, mesh, spec)
    model._pre_shard_params = originals  # type: ignore[attr-defined]
    return model


# ---- fp16 dynamic loss scaling (seed 002; tests/test_loss_scaling.py) ----
class _LocalInfCheckScaler(torch.amp.GradScaler):
    """Unscales each rank's local shards directly (`to_local()`), as a scaler written for plain
    tensors does: DTensor's dispatch, which all-reduces the found-inf flag, never runs."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                        by_dtype.setdefault(local.dtype, []).append(local)
            for grads in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        return {found_inf.device: found_inf}


class _LocalInfCheckView(EngineView):
    def grad_scaler(self, spec, device):
        return _LocalInfCheckScaler(device.type, **spec.scaler_kwargs())


def inf_check_not_all_reduced(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """fp16 loss scaling whose found-inf flag is never all-reduced: each rank checks only its own
    shards, so the rank holding an overflow skips the step while a rank whose shards are finite
    steps (and their scales part)."""
    fully_shard_engine(model, mesh, spec)
    model.verify_view = lambda: _LocalInfCheckView(model)
    return model


class _UnscaleInStepView(EngineView):
    def unscale_(self, scaler, optimizer) -> None:
        pass  # `scaler.step` unscales, after the clip has seen the scaled gradients


def unscale_after_clipping(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Clips before unscaling (no `scaler.unscale_(optimizer)` before `clip_grad_norm_`, the
    documented AMP pitfall): the clip measures the norm of the scaled gradients, `scale` times
    the true one, and clips them by it; `scaler.step` unscales afterwards."""
    fully_shard_engine(model, mesh, spec)
    model.verify_view = lambda: _UnscaleInStepView(model)
    return model


# ---- FSDP1's hybrid and NO_SHARD strategies (verify/engines/fsdp1.py's mesh table) ----------------
def _fsdp1_mutant(fn):  # a decorator
    """An FSDP1 mutant is emulated and held to the contracts as FSDP1 is: caught for its bug,
    not for arithmetic the reference would model otherwise."""
    fn.arithmetic = fsdp1_engine.arithmetic
    fn.contracts = fsdp1_engine.contracts
    fn.capabilities = fsdp1_engine.capabilities  # no fully_shard knobs (offload, placements)
    return fn


@_fsdp1_mutant
def fsdp1_hybrid_replicas_not_reduced(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """A (replicate, shard) mesh run as FULL_SHARD over the shard group alone (the intra-node
    group passed as `process_group`, HYBRID_SHARD forgotten): each replica reduce-scatters and
    averages its own ranks' gradients and never all-reduces with the others."""
    shard_only = placement(mesh[mesh.mesh_dim_names[-1]], spec.reshard_after_forward)
    return wrap_fsdp1(model, mesh, spec, shard_only)


@_fsdp1_mutant
def fsdp1_hybrid_divides_by_shard_group(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """HYBRID_SHARD whose gradient divide factors come from the shard group's size, not the
    whole data-parallel world's (FSDP1 before `_init_process_group_state` multiplied in the
    replicate group's size): the all-reduced sum over the replicas is R times the average."""
    return _fsdp1_divided_by(fsdp1_engine(model, mesh, spec), mesh.size(mesh.ndim - 1))


@_fsdp1_mutant
def fsdp1_no_shard_not_all_reduced(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """HYBRID_SHARD given a (W, 1) mesh, as FSDP1 itself runs it (torch 2.13): a shard group of
    one switches it to NO_SHARD *over that group*, so the all-reduce over the replicas never
    happens; each rank steps on its own gradient divided by W
    (tests/upstream/test_fsdp1_hybrid_shard_group_of_one.py)."""
    from torch.distributed.fsdp import ShardingStrategy

    rsf = spec.reshard_after_forward is not False
    strategy = ShardingStrategy.HYBRID_SHARD if rsf else ShardingStrategy._HYBRID_SHARD_ZERO2
    return wrap_fsdp1(model, mesh, spec, dict(device_mesh=mesh, sharding_strategy=strategy))


@_fsdp1_mutant
def fsdp1_no_shard_divides_by_wrong_world(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """NO_SHARD whose all-reduced sum is divided by one rank fewer than it adds (a world size
    taken without the rank itself, or a hard-coded node size): gradients W / (W - 1) too large."""
    return _fsdp1_divided_by(fsdp1_engine(model, mesh, spec), max(mesh.size() - 1, 1))


def _fsdp1_divided_by(model: nn.Module, world: int) -> nn.Module:
    """Every FSDP1 unit's pre- and post-divide factors set as FSDP1 sets them for `world` ranks."""
    from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    for unit in FSDP.fsdp_modules(model):
        unit._gradient_predivide_factor = DefaultState._get_gradient_predivide_factor(world)
        unit._gradient_postdivide_factor = world / unit._gradient_predivide_factor
    return model


# ---- fully_shard's knobs (issue 28, items 1-4; tests/test_fsdp2_knobs.py) ---------------------------
def offload_grad_added_twice(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Under `offload_policy=CPUOffloadPolicy`, the reduced gradient is added to the CPU copy the
    optimizer steps and again from the device copy it was offloaded from (an offload path that
    accumulates instead of moving): every offloaded gradient counts twice. Without offload it is
    the correct engine."""
    fully_shard_engine(model, mesh, spec)
    if spec.case is not None and spec.case.offload:
        for unit in _units(model):
            unit.set_all_reduce_hook(lambda t: t.mul_(2))
    return model


def shard1_cut_on_dim0(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Each Shard(1) parameter's local shard filled with the rank's dim-0 slice of the full
    tensor, laid out in the shard's (rows, cols / S) shape (a loader that cuts every parameter by
    rows, whatever its placement): the DTensor says Shard(1), the rows say Shard(0). Shard(0)
    parameters are untouched, so with `shard_placement=dim0` it is the correct engine."""
    full = {
        (id(owner), attr): p.detach().clone()
        for owner in model.modules()
        for attr, p in owner.named_parameters(recurse=False)
    }
    fully_shard_engine(model, mesh, spec)
    for unit in _units(model):
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            for fp in group.fsdp_params:
                if fp.fsdp_placement.dim == 0:
                    continue
                source = full[(id(fp._module_info.module), fp._module_info.param_name)]
                local = fp.sharded_param._local_tensor
                rows = source.reshape(fp.mesh_info.shard_mesh_size, -1)[fp.mesh_info.shard_mesh_rank]
                with torch.no_grad():
                    local.copy_(rows.view(local.shape))
    return model


class _ReplicaSyncView(EngineView):
    """`set_requires_all_reduce` as a faulty loop calls it: `never` leaves it off on the last
    micro-batch too, else it is ignored (the all-reduce on every micro-batch)."""

    def __init__(self, module: nn.Module, never: bool):
        super().__init__(module)
        self.never = never

    def set_requires_all_reduce(self, all_reduce: bool) -> None:
        if self.never:
            self.module.set_requires_all_reduce(False)


def replica_all_reduce_skipped_on_last(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """HSDP accumulation that turns the replicas' all-reduce off for the micro-batches before the
    last and never back on (`set_requires_all_reduce(False)` outside the loop): FSDP2 then keeps
    every micro-batch's reduce-scattered sum as partial and never hands a gradient to the
    optimizer."""
    fully_shard_engine(model, mesh, spec)
    model.verify_view = lambda: _ReplicaSyncView(model, never=True)
    return model


def replica_all_reduce_every_microbatch(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """HSDP accumulation asked for (`replica_sync_last`) but `set_requires_all_reduce` never
    called: the replicas all-reduce on every micro-batch. The same average in another order
    (within the tolerance); R - 1 all-reduces per unit too many on the wire."""
    fully_shard_engine(model, mesh, spec)
    model.verify_view = lambda: _ReplicaSyncView(model, never=False)
    return model


class _ReshardAfterBackwardView(EngineView):
    """`set_reshard_after_backward` as a faulty loop calls it: `never` leaves it off on the last
    micro-batch too, else it is ignored (every backward reshards)."""

    def __init__(self, module: nn.Module, never: bool):
        super().__init__(module)
        self.never = never

    def set_reshard_after_backward(self, reshard: bool) -> None:
        if self.never:
            self.module.set_reshard_after_backward(False)


def unsharded_kept_after_the_last_backward(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Accumulation that turns resharding after backward off and never back on
    (`set_reshard_after_backward(False)` outside the loop): every unit is still unsharded after
    the optimizer step, a full copy per rank, and stale: the next step's forward, which gathers
    nothing, computes with the parameters before the step."""
    fully_shard_engine(model, mesh, spec)
    model.verify_view = lambda: _ReshardAfterBackwardView(model, never=True)
    return model


def reshard_after_backward_ignored(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Parameters kept unsharded between micro-batches asked for (`reshard_after_backward_last`)
    but `set_reshard_after_backward` never called: every backward reshards and every forward
    all-gathers again. The same numbers; the all-gathers the knob exists to save, on the wire."""
    fully_shard_engine(model, mesh, spec)
    model.verify_view = lambda: _ReshardAfterBackwardView(model, never=False)
    return model


class _SumLossUndividedView(EngineView):
    """A loop that sums the gradients but forgets to divide each rank's loss by the world size."""

    def sum_loss_divisor(self, world_size: int) -> int:
        return 1


def sum_reduction_loss_not_divided(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """`grad_reduction: sum` half done: `set_gradient_divide_factor(1.0)` on every unit, but the
    loss is not divided by the world size, so every gradient is W times the average (a SUM
    reduction adopted from a trainer that divided its loss elsewhere). Correct under avg."""
    fully_shard_engine(model, mesh, spec)
    _over_engine_view(model, _SumLossUndividedView)
    return model


def _over_engine_view(model: nn.Module, view_type: type, *args) -> None:
    """`view_type`'s methods over the view the engine gave (a pipeline's under pp, which records
    across the stages), so that a mutant of one method changes that method only."""
    own = getattr(model, "verify_view", None)
    base = type(own()) if callable(own) else EngineView
    cls = view_type if issubclass(view_type, base) else type(view_type.__name__, (view_type, base), {})
    model.verify_view = lambda: cls(model, *args)


class _IgnoredUnreducedView(EngineView):
    """A loop that keeps a module out of FSDP but forgets its gradients' all-reduce."""

    def reduce_ignored(self, names: list[str], divide: int) -> None:
        return None


def ignored_grads_not_reduced(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """`fully_shard(..., ignored_params=...)` as asked, but the loop never all-reduces the
    ignored parameters' gradients: each rank steps them with its own micro-batches' gradient and
    the replicas drift apart (FSDP2 says it will not reduce them). Correct without `ignored`."""
    fully_shard_engine(model, mesh, spec)
    model.verify_view = lambda: _IgnoredUnreducedView(model)
    return model


def sum_reduction_factor_left_at_avg(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """`grad_reduction: sum` half done the other way: each rank's loss divided by the world
    size, but `set_gradient_divide_factor` never called, so FSDP2 still averages: every gradient
    is 1/W of the average. Correct under avg."""
    case = spec.case.with_(grad_reduction="avg") if spec.case is not None else None
    return fully_shard_engine(model, mesh, replace(spec, case=case))


def prefetch_one_unit_too_many(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Explicit prefetching asked for k units ahead (`prefetch`), the forward lists built k + 1
    ahead (an off-by-one in a torchtitan-style recipe): the same numbers and the same
    collectives, each unit gathered once per forward, but a unit earlier than planned, so one
    more unit's all-gather output is held at once in forward than the memory plan allows."""
    k = spec.case.prefetch if spec.case is not None else None
    if k is None:
        return fully_shard_engine(model, mesh, spec)
    fully_shard_engine(model, mesh, replace(spec, case=spec.case.with_(prefetch=None)))
    set_prefetching(model, spec.wrap, k, forward_k=k + 1, ignored=spec.case.ignored)
    return model


# ---- optimizers, schedules, what is trained (docs/optimizers-and-schedules.md) --------------------
class _SchedulerTwiceView(EngineView):
    def make_scheduler(self, optimizer, spec, steps):
        scheduler = super().make_scheduler(optimizer, spec, steps)
        if scheduler is not None:
            once = scheduler.step

            def twice(*args, **kwargs):
                once(*args, **kwargs)
                once(*args, **kwargs)

            scheduler.step = twice
        return scheduler


def lr_scheduler_stepped_twice(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """`scheduler.step()` called twice per optimizer step (once inside the accumulation loop's
    last micro-batch, once after `optimizer.step()`): the schedule runs twice as fast; a
    constant rate hides it."""
    fully_shard_engine(model, mesh, spec)
    model.verify_view = lambda: _SchedulerTwiceView(model)
    return model


# The state an optimizer-state round trip written for SGD and Adam knows.
_KNOWN_STATE = ("step", "momentum_buffer", "exp_avg", "exp_avg_sq")


def _reset_unknown_state(optimizer, _args, _kwargs) -> None:
    with torch.no_grad():
        for state in optimizer.state.values():
            for key, value in state.items():
                if key not in _KNOWN_STATE and isinstance(value, torch.Tensor):
                    value.zero_()


class _AdamStateOnlyView(EngineView):
    def make_optimizer(self, spec, params):
        optimizer = super().make_optimizer(spec, params)
        optimizer.register_step_post_hook(_reset_unknown_state)
        return optimizer


def optimizer_state_known_keys_only(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """The optimizer state re-created after every step by code that knows SGD's and Adam's
    entries (`step`, `momentum_buffer`, `exp_avg`, `exp_avg_sq`), as a state offload or
    resharding written for Adam does: every other entry starts over at zero, so Adagrad's `sum`,
    RMSprop's `square_avg` and AMSGrad's `max_exp_avg_sq` are lost each step; SGD and Adam
    cannot show it."""
    fully_shard_engine(model, mesh, spec)
    model.verify_view = lambda: _AdamStateOnlyView(model)
    return model


class _StaleUnfreezeView(EngineView):
    def __init__(self, module: nn.Module, before: dict[str, weakref.ref]):
        super().__init__(module)
        self.before = before

    def unfreeze(self, names: list[str]) -> None:
        for n in names:
            stale = self.before[n]()
            if stale is not None:
                stale.requires_grad_(True)


def unfreeze_misses_sharded_params(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Unfreezes the parameters it collected before sharding (a fine-tuning callback that took
    `model.named_parameters()` before `fully_shard` replaced them with DTensors): the sharded
    parameters the model computes with stay frozen, get no gradient and never train. Held by weak
    reference here, so that only the unfreezing shows (strong ones would also keep the
    unsharded weights alive, which the memory contract catches on its own, as for
    `retains_full_params`)."""
    before = {n: weakref.ref(p) for n, p in model.named_parameters()}
    fully_shard_engine(model, mesh, spec)
    _over_engine_view(model, _StaleUnfreezeView, before)
    return model


def idle_expert_grads_dropped(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """A routed expert that no sample of a micro-batch reached on this rank has its gradient set
    to None after that forward (an "idle experts free their gradients" optimisation): what earlier
    micro-batches accumulated into its sharded gradient is dropped."""
    moe = getattr(model, "moe", None)
    fully_shard_engine(model, mesh, spec)
    if moe is None:
        return model
    sharded = [list(expert.parameters()) for expert in moe.experts]  # the DTensors the optimizer steps
    ran: set[int] = set()
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda _m, _a, _o, e=e: ran.add(e))

    def drop_idle(_module, _args, _out) -> None:
        for e, params in enumerate(sharded):
            if e not in ran:
                for p in params:
                    p.grad = None
        ran.clear()

    moe.register_forward_hook(drop_idle)
    return model


# ---- expert parallelism and grouped experts (docs/expert-parallel.md) ------------------------------
def _with_expert_parallel(style: type):
    """The built-in engine with another token dispatch than torchtitan's."""

    def engine(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
        if spec.case.ep > 1:
            mesh = apply_expert_parallel(model, mesh, style)
        kwargs = spec.fully_shard_kwargs(model, mesh)
        for fqn in spec.wrap:
            unit = spec.unit_modules(model, fqn)
            fully_shard(unit, **spec.unit_kwargs(unit, kwargs))
        spec.after_sharding(model)
        return model

    engine.__doc__ = style.__doc__
    return engine


class _CombinedOutOfOrder(ExpertParallel):
    """Sends the experts' outputs back in the order the ep rank computed them (expert by expert),
    not the order the rows came in: the regrouping after dispatch is never undone, so each rank
    adds other rows' outputs onto its samples (a token combine that forgets the unpermute)."""

    def combine(self, _module, out, mesh):
        from fsdp_verify.engines.expert_parallel import _AllToAll

        return _AllToAll.apply(out, self.in_splits, self.out_splits, mesh.get_group())


ep_tokens_combined_out_of_order = _with_expert_parallel(_CombinedOutOfOrder)


def ep_expert_grads_averaged_over_ep(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Averages the experts' reduced gradients over the ep group too, as if the experts were
    replicated there like the dense parameters (a DDP-style all-reduce over every rank that holds
    "the experts"): each ep rank holds other experts, so their gradients are mixed and divided."""
    fully_shard_engine(model, mesh, spec)
    if spec.case.ep == 1:
        return model
    from fsdp_verify.engines.expert_parallel import EP, grouped_experts

    group, ep = mesh[EP].get_group(), mesh[EP].size()

    def average(t: torch.Tensor) -> None:
        dist.all_reduce(t, group=group)
        t.div_(ep)

    for _, experts in grouped_experts(model):
        experts.set_all_reduce_hook(average)
    return model


def clip_norm_of_one_mesh(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Clips every gradient by the norm of the first mesh's gradients alone (the dense ones beside
    ep, the tp mesh's beside a plan that leaves parameters off it): the other mesh's left out of
    it (a clip that keeps the parameters of one mesh to get past DTensor's "different meshes"
    error, and scales the rest by that norm)."""
    fully_shard_engine(model, mesh, spec)
    if spec.case.ep == 1 and spec.case.tp == 1:
        return model
    from fsdp_verify.engines.view import EngineView, by_mesh

    class DenseNormClip(EngineView):
        def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
            groups = by_mesh([p for p in self.parameters().values() if p.grad is not None])
            norm = torch.nn.utils.get_total_norm([p.grad for p in groups[0]]).full_tensor()
            for params in groups:
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
            return norm

    model.verify_view = lambda: DenseNormClip(model)
    return model


def aux_loss_per_rank(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """The load-balancing loss from each rank's own assignment counts, not the global
    micro-batch's: every rank balances its own samples (a per-rank mean of the aux loss)."""
    for moe in moe_layers(model):
        moe.global_counts = lambda counts: counts
    return fully_shard_engine(model, mesh, spec)


def router_bias_updated_on_rank0_only(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Only rank 0 moves the router bias after a step (an update guarded by `if rank == 0`, the
    broadcast forgotten); the others count, all-reduce and reset like it, and keep their bias."""
    if dist.get_rank() != 0:
        for moe in moe_layers(model):
            moe.update_router_bias = functools.partial(_count_and_reset, moe)
    return fully_shard_engine(model, mesh, spec)


@torch.no_grad()
def _count_and_reset(moe) -> None:
    if not moe.router_bias:
        return
    moe.global_counts(moe.tokens_per_expert)  # the same collective as the others issue
    moe.tokens_per_expert.zero_()


def capacity_drops_differ_on_rank1(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Rank 1 keeps each expert's highest-scoring assignments under capacity, the others its
    first in token order (a priority-dropping code path switched on one rank only): the ranks
    drop by different rules."""
    if dist.get_rank() == 1:
        for moe in moe_layers(model):
            moe.keep = functools.partial(_keep_by_score, moe)
    return fully_shard_engine(model, mesh, spec)


def _keep_by_score(moe, order, flat, counts, limit, probs):
    score = probs[order // moe.top_k, flat[order]]
    kept, start = [], 0
    for count in counts.tolist():
        block, scores = order[start : start + count], score[start : start + count]
        kept.append(block[torch.argsort(scores, descending=True, stable=True)[:limit]].sort().values)
        start += count
    return torch.cat(kept)


# ---- pipeline parallelism (docs/pipeline-parallel.md) ----------------------------------------------
def pp_loss_not_divided_by_microbatches(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """The schedule told not to divide the gradients by the micro-batches (`scale_grads=False`)
    while each micro-batch's loss is scaled for a mean over them: every gradient M times too large.
    Where the case's schedule does not scale (`pp_scale_grads` false, torchtitan's), the opposite:
    told to divide a loss already each micro-batch's share, every gradient M times too small."""
    fully_shard_engine(model, mesh, spec)
    if spec.case.pp > 1:
        model.pipeline.schedule.scale_grads = not spec.case.pp_scale_grads
    return model


class _Detached(torch.autograd.Function):
    """Identity forward; no gradient back (zeros): the activation as if detached."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros_like(grad)


def pp_stage_boundary_detached(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Every stage after the first cuts its input off from the graph (an `x.detach()` at the
    stage boundary): no gradient reaches the earlier stages, which train on weight decay alone."""
    fully_shard_engine(model, mesh, spec)
    if spec.case.pp > 1:
        for stage in model.pipeline.stages:
            if stage.stage_index > 0:
                stage.submod.register_forward_pre_hook(lambda _m, args: tuple(_Detached.apply(a) for a in args))
    return model


def pp_clip_norm_of_own_stages(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Each pp rank clips by the norm of its own stages' gradients, never summed over the "pp"
    group: every stage clips by a smaller norm than the global one (a clip written for FSDP alone,
    kept when the model was split into stages)."""
    fully_shard_engine(model, mesh, spec)
    if spec.case.pp == 1:
        return model
    from fsdp_verify.engines.pipeline_engine import PipelineView

    class OwnStagesClip(PipelineView):
        def over_stages(self, norm: torch.Tensor) -> torch.Tensor:
            return norm

    model.verify_view = lambda: OwnStagesClip(model)
    return model


def pp_stage_reduces_every_microbatch(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """The first stage ignores the schedule's no-sync and reduces on every micro-batch, each
    reduction divided by data-parallel size x micro-batches (a factor meant for one reduction of
    the whole step's sum): its gradients come out M times too small once the schedule divides."""
    fully_shard_engine(model, mesh, spec)
    if spec.case.pp == 1:
        return model
    factor = float(spec.case.dp_size * spec.case.microbatches)
    for stage in model.pipeline.stages:
        if stage.stage_index == 0:
            stage.submod.set_requires_gradient_sync = lambda *_a, **_k: None
            for unit in _units(stage.submod):
                unit.set_gradient_divide_factor(factor)
                unit.set_force_sum_reduction_for_comms(True)
    return model


def pp_microbatches_reversed_on_last_stage(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """The last stage takes the targets' micro-batches in reverse order: each output meets
    another micro-batch's targets (its data loader and the first stage's out of step)."""
    fully_shard_engine(model, mesh, spec)
    if spec.case.pp == 1 or not model.pipeline.last:
        return model
    schedule, m = model.pipeline.schedule, spec.case.microbatches
    step = schedule.step

    def reversed_targets(*args, target=None, **kwargs):
        if target is not None:
            target = torch.cat(list(reversed(target.tensor_split(m))))
        return step(*args, target=target, **kwargs)

    schedule.step = reversed_targets
    return model


def pp_tied_embedding_grads_not_summed(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """The tied embedding's copies on the first and the last stage each keep their own gradient
    (the sum between the stages forgotten): the embedding trains on its lookup's gradient alone,
    the head on its own, and the two copies drift apart."""
    fully_shard_engine(model, mesh, spec)
    if spec.case.pp > 1:
        model.pipeline.sync_tied = lambda: None
    return model


# ---- a checkpoint's resume (verify/training/resume.py; docs/resume.md) -----------------------------
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


class _FreshOptimizer(Checkpointer):
    """Loads the model only: the optimizer after resume is a fresh one (its moments zero), the
    common slip of a resume that restores `model.load_state_dict` and builds a new optimizer."""

    def load(self, path, optimizer):
        model_sd = get_model_state_dict(self.module)
        trainer = trainer_template(path)
        state = {"model": model_sd, "trainer": trainer}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(self.module, state["model"])
        return trainer


class _AdamStepReset(Checkpointer):
    """Loads everything, then resets Adam's step count to 0 (a resume that re-creates the
    per-parameter `step` or loads a checkpoint written before it was saved): the bias
    correction restarts and the first updates after the resume are too large."""

    def after_load(self, optimizer, trainer):
        for state in optimizer.state.values():
            if "step" in state:
                state["step"] = torch.zeros_like(state["step"])
        return trainer


class _PrefixDroppedByNonStrictLoad(Checkpointer):
    """The loading side names a parameter with a wrapper's prefix (`_orig_mod.`, as torch.compile
    does), the checkpoint without it; the load is non-strict (`allow_partial_load`, `strict=False`),
    so that parameter keeps its fresh initial values and nobody is told."""

    def rename(self, model_sd):
        first = next(iter(model_sd))
        return {(f"_orig_mod.{k}" if k == first else k): v for k, v in model_sd.items()}

    def planner(self):
        return DefaultLoadPlanner(allow_partial_load=True)

    def set(self, optimizer, model_sd, optim_sd, strict=True):
        super().set(optimizer, model_sd, optim_sd, strict=False)


class _RngNotRestored(Checkpointer):
    """Loads model, optimizer and the trainer's counters, but not the generators: each rank's
    dropout masks after the resume are those of a fresh seed, not the stream it was on."""

    def after_load(self, optimizer, trainer):
        return {k: v for k, v in trainer.items() if k != "rng"}


class _LossScaleReset(Checkpointer):
    """Loads everything but the loss scaler's state: the scale restarts at `init_scale` and the
    good-step count at 0 (a `GradScaler` built anew on resume)."""

    def after_load(self, optimizer, trainer):
        return {k: v for k, v in trainer.items() if not k.startswith("loss_scale.")}


class _DataPositionReset(Checkpointer):
    """Loads everything but the data loader's position: the resumed run starts the data from
    the beginning, so its first batch is one the run saw already (step 1's)."""

    def after_load(self, optimizer, trainer):
        return {**trainer, "data_position": torch.zeros_like(trainer["data_position"])}


class _SchedulerNotRestored(Checkpointer):
    """Loads everything but the learning-rate schedule's position: the resumed scheduler is a
    fresh one at step 0 (the loop saved `optimizer.state_dict()` but not
    `scheduler.state_dict()`). The loaded lr is right; the next ones are the schedule's from
    the start (LinearLR's warmup restarts)."""

    def after_load(self, optimizer, trainer):
        return {k: v for k, v in trainer.items() if not k.startswith("schedule.")}


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (the tensor itself otherwise), to change in place."""
    return t._local_tensor if isinstance(t, DTensor) else t


class _OptimStateSwapped(Checkpointer):
    """Loads everything, but the optimizer state of two parameters of the same shape lands on
    each other: a state dict keyed by position (`optimizer.state_dict()`'s integer ids) loaded
    into an optimizer whose parameters are listed in another order (built from a dict of
    parameter groups, or after a refactor moved a layer). Same shapes, so nothing complains."""

    def after_load(self, optimizer, trainer):
        seen: dict[tuple[int, ...], nn.Parameter] = {}
        for _, p in self.module.named_parameters():
            if not optimizer.state.get(p):
                continue
            other = seen.setdefault(tuple(p.shape), p)
            if other is not p:
                optimizer.state[p], optimizer.state[other] = optimizer.state[other], optimizer.state[p]
                break
        return trainer


class _OptimStateInBf16(Checkpointer):
    """Loads everything, the optimizer's float state rounded through bf16 (a checkpoint that
    stored Adam's moments in bf16 to save space, read back into fp32 state)."""

    def after_load(self, optimizer, trainer):
        with torch.no_grad():
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.is_floating_point():
                        local = _local(value)
                        local.copy_(local.to(torch.bfloat16).to(local.dtype))
        return trainer


class _LoadedOnRank0Only(Checkpointer):
    """Loads the optimizer on every rank but the model's weights on rank 0 only: the other ranks
    keep the shards of the freshly built model (an `if rank == 0:` left over from a loop that
    loaded a full state dict on rank 0 and broadcast it, the broadcast since removed)."""

    def load(self, path, optimizer):
        fresh = [] if dist.get_rank() == 0 else [_local(p).detach().clone() for p in self.module.parameters()]
        trainer = super().load(path, optimizer)
        with torch.no_grad():
            for p, before in zip(self.module.parameters(), fresh):
                _local(p).copy_(before)
        return trainer


class _WeightDecayFromTheCode(Checkpointer):
    """Loads everything, then applies the loop's own optimizer settings to the param groups
    (`for g in optimizer.param_groups: g.update(config)`), whose `weight_decay` is 0: the saved
    one is overwritten, and the run goes on without weight decay."""

    def after_load(self, optimizer, trainer):
        for group in optimizer.param_groups:
            group["weight_decay"] = 0.0
        return trainer


class _TpShardsOnTheWrongRank(Checkpointer):
    """Loads everything, but one tensor-parallel parameter's tp shards land on the wrong tp ranks
    (rank t holds what rank t + 1 should): a loader that maps the checkpoint's shards to ranks by
    its own position in the tp group, where DCP's reshard reads them by their global offsets (a
    resume that copies `to_local()` pieces by rank index, right only where the tp layout and rank
    order never change). Only the parameter moves; its optimizer state stays where it belongs."""

    def after_load(self, optimizer, trainer):
        for _, p in self.module.named_parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
                continue
            tp = mesh.mesh_dim_names.index("tp")
            if not p.placements[tp].is_shard() or mesh.size(tp) == 1:
                continue
            local = _local(p)
            pieces = [torch.empty_like(local) for _ in range(mesh.size(tp))]
            dist.all_gather(pieces, local.detach().contiguous(), group=mesh.get_group("tp"))
            with torch.no_grad():
                local.copy_(pieces[(mesh.get_local_rank("tp") + 1) % len(pieces)])
            break
        return trainer


class _RngByGlobalRank(Checkpointer):
    """Loads everything, and each rank takes back the generator of its own global rank, as a
    loop without tensor parallelism does: right while the tp degree stays, wrong across a change
    of it (from tp 2 to 1, rank 1 is data-parallel rank 1 but takes the stream of rank 1 of the
    saving run, data-parallel rank 0's): its dropout masks repeat another rank's."""

    def after_load(self, optimizer, trainer):
        rank = dist.get_rank()
        if rank < trainer["rng"].shape[0]:
            torch.set_rng_state(trainer["rng"][rank].clone())
        return {k: v for k, v in trainer.items() if k != "rng"}  # restored here, not by the loop


class _ExpertsInAnotherEpRanksSlots(Checkpointer):
    """Loads everything, then each ep rank's experts (their weights and optimizer state) are the
    ones the next ep rank holds: a loop that saved each rank's local experts under their local
    index (expert 0 of every ep rank one key, no global offset) and reads them back on another
    layout. Same shapes, so nothing complains; every rank computes with another rank's experts."""

    def after_load(self, optimizer, trainer):
        from fsdp_verify.engines.expert_parallel import EP, grouped_experts

        for _, experts in grouped_experts(self.module):
            for p in experts.parameters():
                if not isinstance(p, DTensor) or EP not in (p.device_mesh.mesh_dim_names or ()):
                    continue  # ep 1: every rank holds every expert, no other ep rank's slots
                group = p.device_mesh.get_group(EP)
                for t in [p, *(v for v in optimizer.state.get(p, {}).values() if isinstance(v, DTensor))]:
                    _rotate(_local(t), group)
        return trainer


class _StageLoadsAnotherStage(Checkpointer):
    """Loads everything, but the last stage's blocks take the first stage's saved weights (its
    optimizer state its own): a loop that saved each stage's blocks under their index within the
    stage (`layers.0` the first block of every stage) and loads each stage from the first
    stage's file. Where a block of the other stage has another shape it loads its own."""

    def load(self, path, optimizer):
        self.saved = {k: tuple(v.shape) for k, v in saved_template(path)["model"].items()}
        return super().load(path, optimizer)

    def rename(self, model_sd):
        self.original = model_sd
        pipe = getattr(self.module, "pipeline", None)
        if pipe is None or not pipe.last or pipe.first:
            return model_sd
        blocks = sorted({int(k.split(".")[1]) for k in model_sd if k.startswith("layers.")})
        shift = blocks[0] if blocks else 0

        def other(key: str) -> str:
            head, _, rest = key.partition(".")
            if head != "layers":
                return key
            index, _, tail = rest.partition(".")
            moved = f"layers.{int(index) - shift}.{tail}"
            return moved if self.saved.get(moved) == tuple(model_sd[key].shape) else key

        return {other(k): v for k, v in model_sd.items()}

    def set(self, optimizer, model_sd, optim_sd, strict=True):
        super().set(optimizer, self.original, optim_sd, strict)  # the same tensors, read in place


@torch.no_grad()
def _rotate(local: torch.Tensor, group) -> None:
    """`local` replaced by the next rank's of `group` (a collective)."""
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local.contiguous(), group=group)
    local.copy_(pieces[(dist.get_rank(group) + 1) % len(pieces)])


fresh_optimizer_after_resume = _resuming(_FreshOptimizer)
adam_step_reset_on_resume = _resuming(_AdamStepReset)
prefixed_key_dropped_on_resume = _resuming(_PrefixDroppedByNonStrictLoad)
rng_not_restored_on_resume = _resuming(_RngNotRestored)
loss_scale_reset_on_resume = _resuming(_LossScaleReset)
data_position_reset_on_resume = _resuming(_DataPositionReset)
scheduler_not_restored_on_resume = _resuming(_SchedulerNotRestored)
optimizer_state_swapped_on_resume = _resuming(_OptimStateSwapped)
optimizer_state_in_bf16_on_resume = _resuming(_OptimStateInBf16)
weights_loaded_on_rank0_only = _resuming(_LoadedOnRank0Only)
weight_decay_from_the_code_on_resume = _resuming(_WeightDecayFromTheCode)
tp_shards_on_the_wrong_rank_on_resume = _resuming(_TpShardsOnTheWrongRank)
rng_by_global_rank_on_resume = _resuming(_RngByGlobalRank)
ep_experts_loaded_into_another_ep_rank = _resuming(_ExpertsInAnotherEpRanksSlots)
pp_stage_loads_another_stages_state = _resuming(_StageLoadsAnotherStage)


# ---- torch.compile (issue 41, docs/compile.md) ----------------------------------------------------
class _MatmulWithCompiledGradient(torch.autograd.Function):
    """x @ w^T with its own backward, which returns another weight gradient when a compiler
    traces it (`torch.compiler.is_compiling()`): the shape of pytorch/pytorch#184113, where
    torch.compile changed the gradients of a custom autograd matmul and eager did not. Stands
    for a compiler bug: nothing about sharding, so both compiled runs carry it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_weight = grad.flatten(0, -2).t() @ x.flatten(0, -2)
        if torch.compiler.is_compiling():
            grad_weight = grad_weight.flip(-1)  # the compiled backward's weight gradient, columns reversed
        return grad @ weight, grad_weight


class _CustomMatmul(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) / dim**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(_MatmulWithCompiledGradient.apply(x, self.weight))


class _CustomFunctionLM(nn.Module):
    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.mix = _CustomMatmul(dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.embed(tokens)))


def custom_function_lm(vocab_size: int = 16, dim: int = 8) -> nn.Module:
    """A token model whose middle layer is a custom autograd matmul (`_MatmulWithCompiledGradient`):
    the model of `compiled_backward_differs`, pinned as its case's `model`."""
    return _CustomFunctionLM(vocab_size, dim)


def compiled_backward_differs(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """The correct FSDP2 engine, compile applied as the case asks; its cases' model
    (`custom_function_lm`) holds a custom autograd function whose compiled backward returns
    another gradient than eager's. The sharded run and the compiled reference agree (the same
    compiler, the same bug); the compiled reference against eager names it the compiler's."""
    return fully_shard_engine(model, mesh, spec)


def unit_compiled_with_unsharded_params(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Compiles each unit before fully_shard as a function of its parameters as they are then: the
    unit's forward becomes its twin's (`copy.deepcopy` of the module) called with the original,
    unsharded `nn.Parameter`s (`torch.func.functional_call`). fully_shard replaces those on the
    module with its own and lets the originals be; the compiled forward goes on computing with
    them: every step's forward sees the initial weights, and their gradients go to tensors the
    optimizer does not hold (the sharded parameters of those units get none)."""
    import copy

    for fqn in (m for u in spec.wrap for m in members(u)):
        if not fqn:
            continue
        unit = model.get_submodule(fqn)
        originals = dict(unit.named_parameters())
        twin = copy.deepcopy(unit)

        def stale_forward(*args, _twin=twin, _originals=originals, **kwargs):
            return torch.func.functional_call(_twin, _originals, args, kwargs)

        unit.forward = stale_forward
    return fully_shard_engine(model, mesh, spec)


def hook_dropped_by_compile(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Averages its first unit's gradients by hand once the run has settled, as a home-grown
    engine driving a reduction from module hooks does (and as DDP settles its buckets after the
    first iteration): from the second forward on, FSDP2 sums that unit's gradients over the ranks
    (a divide factor of 1) and a `register_full_backward_pre_hook` on the unit's first layer
    divides the gradient entering it by the world size. Eager, that is the average throughout.
    Compiled, the hook is dropped, silently: the layer reads the data, so none of its inputs
    requires grad, and a compiled frame traced before the hook was registered runs on without it
    (tests/upstream/test_compile_drops_backward_hook_registered_late.py; pytorch/pytorch#117265's
    family). That unit's gradients are then W times the reference's from the second forward on."""
    world = mesh.size()
    first = modules_of(model, spec.wrap[0])[0]
    layer = next(m for m in first.modules() if isinstance(m, nn.Linear))
    fully_shard_engine(model, mesh, spec)
    forwards = [0]

    def settle(_module, _args) -> None:
        forwards[0] += 1
        if forwards[0] == 2:
            layer.register_full_backward_pre_hook(lambda _m, grad_output: tuple(g / world for g in grad_output))
            first.set_force_sum_reduction_for_comms(True)
            first.set_gradient_divide_factor(1.0)

    model.register_forward_pre_hook(settle)
    return model


def recompiles_every_step(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Counts each unit's forwards in a Python attribute the compiled forward reads (`+ 0.0 *
    unit.calls`, a no-op on the numbers, as a step number read for a schedule would be): Dynamo
    specialises on the int, so every forward fails its guard and compiles again, every step."""
    for fqn in (m for u in spec.wrap for m in members(u)):
        if not fqn:
            continue
        unit = model.get_submodule(fqn)
        unit.calls = 0
        forward = unit.forward

        def counting_forward(*args, _unit=unit, _forward=forward, **kwargs):
            _unit.calls += 1
            return _forward(*args, **kwargs) + 0.0 * _unit.calls

        unit.forward = counting_forward
    return fully_shard_engine(model, mesh, spec)


# ---- tensor parallelism (issue 39) -----------------------------------------------------------------
@dataclass(frozen=True)
class _MutatedPlanSpec(ShardSpec):
    """The case's spec with its tensor-parallel plan replaced by `plan` (a mutation of it): the
    built-in engine applies it where it applies the case's (on the whole model, before a
    pipeline's split), so the mutants below run under pp too."""

    plan: dict | None = None

    def parallelize(self, model: nn.Module, mesh: DeviceMesh) -> DeviceMesh:
        from fsdp_verify.engines.spec import data_parallel_mesh
        from fsdp_verify.engines.tensor_parallel import apply_plan

        if self.stage is None:
            apply_plan(model, mesh["tp"], self.plan)
        return data_parallel_mesh(mesh)


def _parallel_then_shard(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec, plan: dict) -> nn.Module:
    """The fsdp2 engine with `plan` (a mutation of the case's) applied over "tp" first."""
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(ShardSpec)}
    return fully_shard_engine(model, mesh, _MutatedPlanSpec(**fields, plan=plan))


def _plan(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> dict:
    from fsdp_verify.engines.tensor_parallel import plan_for

    return plan_for(spec.case, model, mesh["tp"])


def tp_norm_grad_not_reduced(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Sequence parallelism written by hand: the norms run on each rank's sequence shard with
    their weights as plain tensors (the plan's SequenceParallel left out), so nothing marks their
    gradients partial and nothing sums them over tp: each tp rank keeps the gradient of its own
    shard (Megatron's `sequence_parallel` attribute forgotten)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    plan = {k: v for k, v in _plan(model, mesh, spec).items() if not isinstance(v, SequenceParallel)}
    return _parallel_then_shard(model, mesh, spec, plan)


def rowwise_output_not_all_reduced(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """A row-parallel linear whose partial output goes on as it is: each rank's share of the sum,
    never all-reduced (the reduction in the output hook forgotten)."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    class _Unreduced(RowwiseParallel):
        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
            return outputs.to_local()  # Partial: this rank's share only

    plan = {
        k: _Unreduced(input_layouts=v.input_layouts[0]) if type(v) is RowwiseParallel and _linear(model, k) else v
        for k, v in _plan(model, mesh, spec).items()
    }
    return _parallel_then_shard(model, mesh, spec, plan)


def _linear(model: nn.Module, fqn: str) -> bool:
    return isinstance(model.get_submodule(fqn), nn.Linear)


class _AllReduceGradInParamDtype(torch.autograd.Function):
    """Identity; backward: the gradient all-reduced over `group` in its own dtype."""

    @staticmethod
    def forward(ctx, weight, group):
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Grouped(torch.autograd.Function):
    """Identity both ways, one autograd node: the module's own uses of its input add up first."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def tp_grad_all_reduce_in_bf16(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Sequence parallelism by hand that does sum the norms' partial gradients over tp, in the
    gradient's dtype (param_dtype, bf16) while reduce_dtype is fp32 (Megatron's sequence-parallel
    gradient all-reduce in the model's dtype): what pytorch/pytorch#190626 is in FSDP2 itself."""
    from torch.distributed.tensor.parallel import SequenceParallel

    from fsdp_verify.models.transformer import RMSNorm

    plan = _plan(model, mesh, spec)
    group = mesh["tp"].get_group()
    for fqn, style in plan.items():
        norm = model.get_submodule(fqn)
        if isinstance(style, SequenceParallel) and isinstance(norm, RMSNorm):

            def forward(x, norm=norm):
                x = _Grouped.apply(x)  # as DTensor.from_local groups the input's gradient sum
                weight = _AllReduceGradInParamDtype.apply(norm.weight, group)
                normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + norm.eps)
                return (normed * weight.float()).to(weight.dtype)

            norm.forward = forward
    plan = {k: v for k, v in plan.items() if not isinstance(v, SequenceParallel)}
    return _parallel_then_shard(model, mesh, spec, plan)


def fsdp_over_tp_dim(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """The mesh's dims taken the wrong way round: the plan applied over the data-parallel dim and
    `fully_shard` over "tp" (an `init_device_mesh(("dp", "tp"))` read as ("tp", "dp")), so
    ranks with different batches compute one layer's shards between them."""
    from fsdp_verify.engines.tensor_parallel import apply_plan, plan_for

    shard = mesh["shard"]
    apply_plan(model, shard, plan_for(spec.case, model, shard))
    kwargs = spec.fully_shard_kwargs(model, mesh["tp"])
    for fqn in spec.wrap:
        fully_shard(spec.unit_modules(model, fqn), **kwargs)
    spec.after_sharding(model)
    return model


def dp_and_tp_dims_swapped(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """The world mesh built with its data-parallel and tp dims swapped (the degrees listed in
    another order than the names, as a hand-built `DeviceMesh(arange(W).view(...))` does): a tp
    group is ranks of different data-parallel ranks, which compute one layer's shards on
    different batches; under pp the stages stay whole. Correct where the shard dim is 1."""
    names = mesh.mesh_dim_names
    s, t = names.index("shard"), names.index("tp")
    swapped = DeviceMesh(mesh.device_type, mesh.mesh.transpose(s, t).contiguous(), mesh_dim_names=names)
    return fully_shard_engine(model, swapped, spec)


def tp_plan_on_first_stage_only(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Under pp, the tp plan applied to the first stage's modules only (a parallelize function
    called on `model_parts[0]` where each part needed it): the later stages' weights stay whole
    on every tp rank, computing the same as their tp group (the same numbers, none of the
    memory tp exists to save). Without pp it is the correct engine."""
    from fsdp_verify.engines.pipeline_parallel import split, stages_per_rank

    case, plan = spec.case, _plan(model, mesh, spec)
    if case.pp > 1:
        first = {id(p) for p in split(case, model, case.pp * stages_per_rank(case.pp_schedule))[0].parameters()}
        plan = {k: v for k, v in plan.items() if all(id(p) in first for p in model.get_submodule(k).parameters())}
    return _parallel_then_shard(model, mesh, spec, plan)


def colwise_bias_replicated(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """A column-parallel linear's bias left whole (replicated) while its weight is split: every
    rank adds the bias's first chunk to its slice of the output, the shard rank 0 would hold."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel

    class _BiasHead(ColwiseParallel):
        def _partition_linear_fn(self, name, module, device_mesh):
            module.register_parameter("weight", nn.Parameter(distribute_tensor(module.weight, device_mesh, [Shard(0)])))
            if module.bias is not None:
                head = module.bias.detach()[: module.bias.shape[0] // device_mesh.size()].clone()
                module.register_parameter("bias", nn.Parameter(DTensor.from_local(head, device_mesh, [Shard(0)])))

    plan = {
        k: _BiasHead(output_layouts=v.output_layouts[0], use_local_output=v.use_local_output)
        if type(v) is ColwiseParallel and _linear(model, k)
        else v
        for k, v in _plan(model, mesh, spec).items()
    }
    return _parallel_then_shard(model, mesh, spec, plan)


# The loss-parallel mutant: its model's next cross-entropy under `loss_parallel()` takes the
# log-softmax of each rank's vocabulary shard alone. torch's handler is patched once in a process
# that runs it and acts only on the first log-softmax after such a model's forward (`_armed`).
_armed = [False]


def _install_local_log_softmax() -> None:
    from torch.distributed.tensor.parallel import loss as tp_loss

    aten = torch.ops.aten
    handlers = tp_loss.customized_loss_ops
    correct = handlers[aten._log_softmax.default]
    if getattr(correct, "mutant", False):
        return

    def handler(op_call, args, kwargs):
        if not _armed[0]:
            return correct(op_call, args, kwargs)
        _armed[0] = False
        x = args[0]
        local = torch.log_softmax(x._local_tensor, args[1])  # no max or sum over the ranks
        return type(x)(local, x._spec, requires_grad=local.requires_grad)

    handler.mutant = True
    handlers[aten._log_softmax.default] = handler


def loss_parallel_without_vocab_reduction(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Loss parallelism without its reductions over the vocabulary: each rank normalises its
    shard of the logits by its own max and sum of exponentials (a home-grown vocab-parallel
    cross-entropy missing its all-reduces), so every probability is over a shard of the vocabulary."""
    _install_local_log_softmax()
    model.register_forward_pre_hook(lambda *_: _armed.__setitem__(0, True))
    return fully_shard_engine(model, mesh, spec)


def dropout_seeded_per_rank(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Each rank's generator seeded by its global rank (`seed + rank`, not `seed + dp_rank`) at the
    first forward: the tp ranks draw different dropout masks for an activation they all hold."""
    seeded = [False]
    rank = dist.get_rank()

    def reseed(*_):
        if not seeded[0]:
            seeded[0] = True
            torch.manual_seed(spec.case.seed * 7919 + 1000003 * (rank + 1))

    fully_shard_engine(model, mesh, spec)
    model.register_forward_pre_hook(reseed)
    return model


def embedding_tokens_not_masked(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """A vocabulary-sharded embedding (RowwiseParallel) written by hand that clamps a token
    outside its rows onto its first or last row instead of masking it out: every rank adds a row
    for every token, and the partial outputs' sum counts tokens several times."""
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

    class _Clamped(ParallelStyle):
        def __init__(self, style):
            self.output_layouts, self.use_local_output = style.output_layouts, style.use_local_output

        def _apply(self, module, device_mesh):
            module.register_parameter("weight", nn.Parameter(distribute_tensor(module.weight, device_mesh, [Shard(0)])))
            rows, lo = (
                module.num_embeddings // device_mesh.size(),
                device_mesh.get_local_rank() * (module.num_embeddings // device_mesh.size()),
            )

            def forward(tokens):
                local = torch.nn.functional.embedding((tokens - lo).clamp(0, rows - 1), module.weight.to_local())
                out = DTensor.from_local(local, device_mesh, [Partial()]).redistribute(placements=self.output_layouts)
                return out.to_local() if self.use_local_output else out

            module.forward = forward
            return module

    plan = {
        k: _Clamped(v) if isinstance(v, RowwiseParallel) and isinstance(model.get_submodule(k), nn.Embedding) else v
        for k, v in _plan(model, mesh, spec).items()
    }
    return _parallel_then_shard(model, mesh, spec, plan)


def _declare_what_fully_shard_engine_takes() -> None:
    """Each mutant above that is a mutation of the built-in FSDP2 engine takes every knob it
    takes (verify/engines/capabilities.py), so the zoo is drawn what `fsdp2` is drawn; those on
    FSDP1 or the flat engine declared their own."""
    for fn in list(globals().values()):
        is_engine = inspect.isfunction(fn) and fn.__module__ == __name__ and not fn.__name__.startswith("_")
        takes_a_spec = is_engine and list(inspect.signature(fn).parameters) == ["model", "mesh", "spec"]
        if takes_a_spec and not hasattr(fn, "capabilities"):
            fn.capabilities = fully_shard_engine.capabilities


_declare_what_fully_shard_engine_takes()
