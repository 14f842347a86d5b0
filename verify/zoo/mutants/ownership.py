"""Ownership, initialisation, RNG and shared state (tests/test_ownership.py, test_rng.py,
test_shared_state.py): who holds a parameter and whether every rank starts from, draws from and
keeps the same values: a tie broken, frozen weights that move, a rank initialised or seeded
apart, buffers left off rank 0, an optimizer holding stale parameters."""

from __future__ import annotations

import torch
import torch.distributed as dist
from hypothesis import strategies as st
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_verify.engines.fsdp2 import fully_shard_engine
from fsdp_verify.engines.spec import ShardSpec
from fsdp_verify.engines.view import EngineView
from fsdp_verify.training.checkpointing import checkpoint_units
from fsdp_verify.zoo.pins import CHEAP
from fsdp_verify.zoo.registry import registrar

bug = registrar(__name__)


@bug(
    "activation checkpointing with preserve_rng_state=False: backward recomputes dropout with new masks",
    "issue 11: activation checkpointing that recomputes dropout with another RNG state",
    ("grads", "rng"),
    world_sizes=(1, 2, 3, 4),
    pins={**CHEAP, "model.dropout": st.sampled_from((0.1, 0.5)), "activation_checkpointing": False},
)
def checkpoint_without_rng_state(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Activation checkpointing on every unit with `preserve_rng_state=False` ("it is faster"):
    the recomputation in backward draws new dropout masks, so the gradients belong to a forward
    that never ran, and each rank's generator ends the step further on than it should."""
    checkpoint_units(model, spec.case.wrap_plan if spec.case is not None else (), preserve_rng_state=False)
    return fully_shard_engine(model, mesh, spec)


@bug(
    "rank 1 initialises its parameters differently and nothing synchronises them",
    "seed 004: CPU vs CUDA generators, trunc_normal_ draws, meta-device init consuming RNG",
    ("init",),
    pins=dict(CHEAP),
)
def rank1_different_init(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Rank 1 re-initialises before sharding and nothing syncs module states (no broadcast from
    rank 0), so its shards hold other values."""
    if dist.get_rank() == 1:
        generator = torch.Generator().manual_seed(12345)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02, generator=generator)
    return fully_shard_engine(model, mesh, spec)


@bug(
    "the output head tied to the embedding gets its own copy when sharding; they train apart",
    "seed 003: shared params must sit in one FSDP unit; tied embeddings untied by re-registration",
    ("ownership", "init", "params", "grads", "param_sums"),
    model_kinds=("transformer",),
    pins={**CHEAP, "model.tie_embeddings": True, "model.frozen": ()},
)
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


@bug(
    "frozen (requires_grad=False) parameters get gradients and the optimizer moves them",
    "FSDP1 use_orig_params=False flat parameters mixing frozen and trainable weights",
    ("grads", "params"),
    world_sizes=(1, 2, 3, 4),
    pins={**CHEAP, "model.frozen": ("layers.0.linear.weight",)},
)
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
