"""Expert parallelism composed with FSDP2, as torchtitan applies it (its `ExpertParallel` style
and `apply_fsdp`; docs/expert-parallel.md).

The mesh: with `ep` the engine is handed the data-parallel mesh with its shard dim S unflattened
into (S / ep, ep), named ("efsdp", "ep") or ("replicate", "efsdp", "ep"). FSDP2 shards the dense
parameters over ("shard",) or ("replicate", "shard"), every data-parallel rank as without ep;
the grouped experts' parameters are first distributed Shard(0) over "ep" (each rank of an ep
group holds experts / ep of them), then sharded by FSDP2 over ("efsdp",) or ("replicate",
"efsdp"): what is left. Every rank still trains on its own samples; the ep ranks exchange the
tokens routed to each other's experts with an all-to-all before the experts and back after.

The experts' unit reduces over fewer ranks than the dense ones, yet its gradient is a sum over
every rank's tokens: an expert's gradient on an ep rank already adds the ep group's tokens, the
reduce-scatter over "efsdp" and the all-reduce over "replicate" add the rest, and the total is
divided by the data-parallel world size, not by the experts' mesh (`set_gradient_divide_factor`,
as torchtitan sets it; on gloo, which has no PREMUL_SUM, with the sum forced, as
`spec.sum_reduction` explains).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor

from fsdp_verify.validation import check, is_int

EP, EXPERTS_SHARD, SHARD = "ep", "efsdp", "shard"


# ---- the case -----------------------------------------------------------------------------------
def experts_of(model) -> dict[str, int]:
    """The model's grouped experts modules and how many experts each holds: the built-in MLP's
    `moe.experts`, or those a model's meta-device build shows (verify/models/moe.py `experts_held`)."""
    if model.is_custom:
        from fsdp_verify.models.custom import info

        return dict(info(model).grouped_experts)
    return {"moe.experts": model.experts} if model.grouped_experts is not None else {}


def check_experts(case) -> None:
    """The grouped experts' settings beside the loop, and the case's `ep`: a degree that divides
    the experts and the shard dim, over the grouped experts in a unit of their own, beside only
    what the reference models with it."""
    model = case.model
    if model.aux_loss:
        # Its gradient is added in backward unscaled, as DeepSeek's AddAuxiliaryLoss adds it: a
        # loss the loop divides by the world size or multiplies by a loss scale would leave it
        # W times or 1/scale off the rest (and the reference's one-rank calibration run with it).
        for name, value, off in (
            ("grad_reduction", case.grad_reduction, "avg"),
            ("loss_scaling", case.loss_scaling, None),
        ):
            check(
                value == off,
                "model.aux_loss",
                f"0 with {name} {value!r}: the load-balancing loss's gradient is added unscaled (AddAuxiliaryLoss)",
                model.aux_loss,
            )
    if model.router_bias:
        # The loop moves the bias after its optimizer step; a user's step steps its own, and a
        # checkpointed forward, recomputed in backward, would count its assignments twice.
        check(case.step is None, "model.router_bias", "0 with a user's step (the loop updates the bias)", 1)
        check(
            not case.activation_checkpointing,
            "model.router_bias",
            "0 under activation checkpointing (a recomputed forward counts its assignments twice)",
            model.router_bias,
        )
    ep = case.ep
    check(is_int(ep) and ep >= 1, "ep", "a positive integer (1: no expert parallelism)", ep)
    # torch's pipelining runs each stage's forward once more at the first step, in training mode, a
    # later stage on uninitialized memory: a MoE's token counts (torchtitan's load balancing) take
    # that in (tests/upstream/test_pipelining_metadata_forward_in_training_mode.py)
    check(
        case.pp == 1 or not (model.is_custom and experts_of(model)),
        "pp",
        "1 for a model's own grouped experts (torch's pipelining runs a stage's forward once more"
        " in training mode at the first step, on uninitialized memory: not modelled)",
        case.pp,
    )
    if ep == 1:
        return
    counts = experts_of(model)
    check(
        bool(counts),
        "ep",
        f"1 unless the model has grouped routed experts (an MLP with --experts N --top-k K, or a model's"
        f" module with `num_experts` and its parameters one row an expert): ep={ep} shards them",
        ep,
    )
    for n in sorted(set(counts.values())):
        check(n % ep == 0, "ep", f"a divisor of the experts ({n})", ep)
    shard = case.mesh[-1]
    check(
        shard % ep == 0,
        "ep",
        f"a divisor of the shard dimension {shard} (mesh {case.mesh}): the ep ranks are carved out of it",
        ep,
    )
    if not model.is_custom:  # a model's own experts sit where its engine puts them (torchtitan: in each block)
        check(
            "moe.experts" in case.wrap_plan,
            "wrap",
            f"a plan with 'moe.experts' as a unit of its own with ep={ep} (its parameters live on the ep mesh)",
            case.wrap_plan,
        )
    if shard == ep:
        low = case.precision.reduce_dtype or case.precision.param_dtype
        check(
            low != "fp16",
            "precision.reduce_dtype",
            f"not fp16 with ep={ep} equal to the shard dimension: FSDP2 (torch 2.13) divides the experts'"
            " gradients twice over a reduce-scatter group of one"
            " (tests/upstream/test_fsdp2_divide_factor_shard_group_of_one.py)",
            low,
        )
    from fsdp_verify.dims.together import check_together

    check_together(case, EP)


# ---- the mesh -----------------------------------------------------------------------------------
def expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The data-parallel `mesh`, (shard,) or (replicate, shard), with its shard dim unflattened
    into ("efsdp", "ep"): what an engine is handed under expert parallelism (the worker makes it
    once, verify/sharded/worker.py: its groups outlive a case)."""
    return mesh._unflatten(SHARD, (mesh.size(mesh.ndim - 1) // ep, ep), (EXPERTS_SHARD, EP))


def dense_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards the dense parameters over: every data-parallel rank, (shard,) or
    (replicate, shard), the mesh `expert_mesh` unflattened."""
    if EP not in (mesh.mesh_dim_names or ()):
        return mesh
    return mesh._get_root_mesh()


def experts_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards the experts over: the data-parallel ranks the ep dim leaves."""
    names = mesh.mesh_dim_names or ()
    return mesh["replicate", EXPERTS_SHARD] if "replicate" in names else mesh[EXPERTS_SHARD]


# ---- the style ----------------------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` of rows, and in backward the same exchange the other way."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class ExpertParallel:
    """torchtitan's ExpertParallel for `GroupedExperts(x, counts)`: its parameters distributed
    Shard(0) over the ep mesh; before its forward, each rank's rows (sorted by expert, `counts`
    per expert) sent to the ep rank holding their expert and regrouped there expert by expert,
    sources in rank order within each (`counts` becomes (local experts, ep)); after it, the rows
    put back in the order they came and returned."""

    def __init__(self) -> None:
        self.in_splits: list[int] = []
        self.out_splits: list[int] = []
        self.order: torch.Tensor | None = None  # received row -> its place expert by expert

    def partition(self, _name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for name, param in list(module.named_parameters(recurse=False)):
            # Frozen stays frozen: `nn.Parameter` alone would make it trainable again.
            sharded = distribute_tensor(param.data, mesh, [Shard(0)])
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))

    def dispatch(self, _module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x, counts = inputs
        ep, group = mesh.size(), mesh.get_group()
        per_expert = counts.reshape(-1)
        local = per_expert.numel() // ep
        with torch.no_grad():
            received = torch.empty_like(per_expert)
            dist.all_to_all_single(received, per_expert, group=group)  # (source, local expert)
        self.in_splits = per_expert.view(ep, local).sum(1).tolist()
        self.out_splits = received.view(ep, local).sum(1).tolist()
        rows = _AllToAll.apply(x, self.out_splits, self.in_splits, group)
        # Regroup expert by expert, sources in rank order within each (GroupedLinear's layout).
        by_source = received.view(ep, local)
        starts = torch.cumsum(by_source.reshape(-1), 0) - by_source.reshape(-1)
        self.order = torch.cat(
            [
                torch.arange(int(starts[s * local + e]), int(starts[s * local + e] + by_source[s, e]))
                for e in range(local)
                for s in range(ep)
            ]
            or [torch.zeros(0, dtype=torch.long)]
        )
        return rows[self.order], by_source.t().contiguous()

    def combine(self, _module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        back = torch.empty_like(out).index_copy(0, self.order, out)  # the rows in the order they came
        return _AllToAll.apply(back, self.in_splits, self.out_splits, mesh.get_group())

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, mesh, self.partition, input_fn=self.dispatch, output_fn=self.combine)


def grouped_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from fsdp_verify.models.moe import grouped_experts_modules

    return grouped_experts_modules(model)


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, style: type = ExpertParallel) -> DeviceMesh:
    """Every grouped experts module of `model` distributed over mesh["ep"] (`style`), each told
    the mesh FSDP2 shards it over (`fsdp_mesh`, what `ShardSpec.unit_kwargs` hands it); returns
    the dense parameters' mesh."""
    for _, experts in grouped_experts(model):
        style().apply(experts, mesh[EP])
        experts.fsdp_mesh = experts_mesh(mesh)
    return dense_mesh(mesh)


def on_ep_mesh(param: torch.Tensor) -> bool:
    return isinstance(param, DTensor) and EP in (param.device_mesh.mesh_dim_names or ())


def experts_divide_factor(model: nn.Module, world: int) -> None:
    """The experts' units divide their gradients by the data-parallel world size (see the module
    docstring). On gloo, which has no PREMUL_SUM, the sum is forced where the experts' reduce-
    scatter group has two ranks or more; a group of one issues no reduce-scatter, and a forced sum
    there would divide twice (torch 2.13: tests/upstream/test_fsdp2_divide_factor_shard_group_of_one.py)."""
    gloo = dist.get_backend() == "gloo"
    for unit in model.modules():
        if isinstance(unit, FSDPModule) and any(on_ep_mesh(p) for p in unit.parameters(recurse=False)):
            unit.set_gradient_divide_factor(float(world))
            mesh = getattr(unit, "fsdp_mesh", None)
            if gloo and (mesh is None or mesh.size(mesh.ndim - 1) > 1):
                unit.set_force_sum_reduction_for_comms(True)
