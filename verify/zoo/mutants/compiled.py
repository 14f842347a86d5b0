"""torch.compile (issue 41, docs/compile.md): a compiler's own bug, and sharding bugs that only a
compiled run shows. Drawn on aot_eager (Dynamo and AOTAutograd without Inductor's code
generation), which shows each of these (what they get wrong is traced, not generated) at a
fraction of Inductor's cost; no dropout where the compiled and eager runs are compared."""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_verify.engines.fsdp2 import fully_shard_engine
from fsdp_verify.engines.spec import ShardSpec
from fsdp_verify.units import members, modules_of
from fsdp_verify.zoo.pins import CHEAP
from fsdp_verify.zoo.registry import registrar

bug = registrar(__name__)


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


@bug(
    "a custom autograd matmul whose compiled backward returns another gradient than eager's (correct sharding)",
    "pytorch/pytorch#184113: torch.compile changed the gradients of a custom autograd matmul (high"
    " priority, silent); a compiler's bug, named the compiler's by the compiled-against-eager check",
    ("compiler",),
    world_sizes=(1, 2, 3, 4),
    pins={
        **CHEAP,
        "model": "fsdp_verify.zoo.mutants:custom_function_lm",
        "compile": "model",
        "compile_backend": "aot_eager",
    },
)
def compiled_backward_differs(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """The correct FSDP2 engine, compile applied as the case asks; its cases' model
    (`custom_function_lm`) holds a custom autograd function whose compiled backward returns
    another gradient than eager's. The sharded run and the compiled reference agree (the same
    compiler, the same bug); the compiled reference against eager names it the compiler's."""
    return fully_shard_engine(model, mesh, spec)


@bug(
    "each unit compiled before fully_shard as a function of its unsharded parameters: stale weights,"
    " gradients to tensors the optimizer does not hold",
    "a functional compile of each block ahead of sharding (`functional_call` with the block's parameters"
    " as they are then), torchtitan's compile-before-fully_shard order gone wrong",
    ("grads",),
    world_sizes=(1, 2, 3, 4),
    precisions=("fp32",),
    # float8 off: the twin, copied before the engine converts the unit, would compute unconverted
    # and part at the step-1 logits, another bug's symptom (a draw after issue 51 met it)
    pins={
        **CHEAP,
        "compile": "units",
        "compile_backend": "aot_eager",
        "model.widths": st.just((7, 5, 3)),
        "dims.float8.recipe": None,
    },
)
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


@bug(
    "the first unit averaged, from the second forward on, by a full backward pre-hook on its input layer,"
    " which torch.compile drops: that unit's gradients summed over ranks",
    "home-grown engines that drive reductions from module hooks; pytorch/pytorch#117265's family (module"
    " backward hooks silently ignored under torch.compile)",
    ("grads",),
    pins={
        "steps": 2,
        "compile": "units",
        "compile_backend": "aot_eager",
        "grad_reduction": "avg",
        "ignored": (),
        "model.widths": st.tuples(st.integers(1, 12), st.integers(2, 12), st.integers(1, 12)),
        "wrap": ("layers.0", ""),
    },
)
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


@bug(
    "each unit's compiled forward reads a Python counter: its guard fails and it compiles again every step",
    "an int read in a compiled region (a step number for a schedule): a recompilation per step",
    ("compile",),
    world_sizes=(1, 2, 3, 4),
    # One micro-batch and two blocks: a recompilation or two a step, well below Dynamo's limit;
    # three steps, so that it compiles again in two of them (once could be Dynamo's own).
    pins={
        "steps": 3,
        "microbatches": 1,
        "model.widths": st.just((5, 7, 3)),
        "compile": "units",
        "compile_backend": "eager",
    },
)
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
