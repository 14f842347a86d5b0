"""What tensor parallelism changes in the arithmetic, emulated on one device (docs/tensor-parallel.md).

The reference stays one process and one full model. Each emulated data-parallel rank's pass runs
its tp ranks side by side: every tensor inside the tensor-parallel region is a `Ranks`, one local
tensor per tp rank, and every op runs on each (a `__torch_dispatch__` wrapper, nothing of
DTensor's). The plan's styles (their layouts, read from the plan as data) decide where the ranks'
tensors meet, and there the collectives are emulated in gloo's order:

- ColwiseParallel: each rank's linear on its rows of the weight; the input's gradient is partial
  (each rank's from its columns) and summed over the ranks (all-reduce, or reduce-scatter where the
  input was a sequence shard), the output gathered where asked;
- RowwiseParallel: each rank's linear on its columns of the input and of the weight, the partial
  outputs summed (all-reduce, or reduce-scatter over the sequence under sequence parallelism);
  an embedding's rows split over the vocabulary, tokens outside a rank's rows looked up as 0 and
  zeroed (`_MaskPartial`);
- SequenceParallel: the norm on each rank's sequence shard; its weight's gradient is partial, one
  per rank, summed over the tp ranks in `reduce_dtype` (the contract `MixedPrecisionPolicy`
  documents; `combine`): torch 2.13's FSDP2 sums them in param_dtype, pytorch/pytorch#190626;
- PrepareModuleInput: the sequence shards gathered before the attention and the feed-forward;
- loss parallelism: the cross-entropy over vocabulary shards (`vocab_parallel_cross_entropy`),
  its max and its sum of exponentials reduced over the ranks, as torch's `loss_parallel()` does.

Dropout inside the region draws from the emulated rank's generator for every tp rank from the same
state (the ranks of a tp group are seeded alike, verify/sharded/loop.py): a replicated activation
gets one mask on every tp rank; on a sequence shard each rank draws its shard's mask from that same
state. (DTensor's offset-based RNG, which would draw the global mask's slices, refuses CPU meshes in
torch 2.13, and the plans here apply dropout to local tensors, where it does not act on any device.)

Where the ranks' partial sums meet in another order than the single device's, the emulation adds
them as the ranks do, so a correct engine agrees bit for bit where the order is fixed: two tp ranks
add commutatively; more are added in gloo's ring order (`gloo_allreduce_sum`). A `Ranks` has its
local shape, a DTensor its global one; where autograd picks a kernel by the strides (a rowwise
linear's input, `mm_mat1_backward`) the `Ranks` carries the DTensor's (`_as_sharded_input`). The
gradients leave
as full tensors (a sharded parameter's shards concatenated), except that a partial gradient stays
one per tp rank, stacked, until `combine` sums it where FSDP2 reduces it (after a no-sync
micro-batch's accumulation, which FSDP2 does per rank in reduce_dtype). `per_tp_rank` runs the
data-parallel reduction on each tp rank's local shards, as FSDP2 reduce-scatters them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from fsdp_verify.engines.arithmetic import gloo_allreduce_sum, squared_norms_reduced

_RANDOM = torch.Tag.nondeterministic_seeded


class Ranks(torch.Tensor):
    """One local tensor per tp rank, run through every op together (`locals[r]` is rank r's).
    `placement` marks a DTensor a style left as one (`use_local_output=False`): ("shard", dim) or
    ("replicate",); None for the local tensors the plans hand between modules."""

    locals: list[torch.Tensor]
    placement: tuple | None

    @staticmethod
    def __new__(cls, locals: list[torch.Tensor], placement: tuple | None = None, strides: tuple | None = None):
        first = locals[0]
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            first.shape,
            strides=strides or first.stride(),
            dtype=first.dtype,
            device=first.device,
            requires_grad=False,
        )
        out.locals = locals
        out.placement = placement
        return out

    def __repr__(self) -> str:
        return f"Ranks({len(self.locals)} x {tuple(self.shape)}, {self.dtype}, placement={self.placement})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        n = _count((args, kwargs))

        def mine(r: int):
            return tree_map(lambda a: a.locals[r] if isinstance(a, Ranks) else a, (args, kwargs))

        results = []
        state = torch.get_rng_state() if _RANDOM in func.tags else None
        for r in range(n):
            if state is not None:  # every tp rank's generator stands where the group's does
                torch.set_rng_state(state)
            a, k = mine(r)
            results.append(func(*a, **k))
        if torch.Tag.inplace in func.tags or func._schema.name.endswith("_"):
            return args[0]
        if "out" in kwargs:
            return kwargs["out"]
        out = _wrap(results)
        if func in _KEEPS_LAYOUT and isinstance(out, Ranks) and out.shape == args[0].shape:
            # a DTensor stays one through a cast (FSDP2's output_dtype) or an alias of itself (an
            # identity autograd node's output: FSDP2's post-backward node on a unit's inputs)
            out.placement = args[0].placement
        elif torch.Tag.pointwise in func.tags and isinstance(out, Ranks):
            # a pointwise op of DTensors of one layout is a DTensor of it (a residual add of two
            # sequence shards, where a plan keeps its activations DTensors: torchtitan's), so a
            # style after it takes it as one, with no `from_local` node of its own
            ranks = [a for a in tree_leaves((args, kwargs)) if isinstance(a, Ranks)]
            placements = {a.placement for a in ranks}
            if len(placements) == 1 and None not in placements and all(a.shape == out.shape for a in ranks):
                out.placement = placements.pop()
        return out


_aten = torch.ops.aten
_KEEPS_LAYOUT = (
    _aten._to_copy.default,
    _aten.clone.default,
    _aten.detach.default,
    _aten.alias.default,
    _aten.view.default,
)


def _count(tree) -> int:
    found: list[int] = []
    tree_map(lambda a: found.append(len(a.locals)) if isinstance(a, Ranks) else None, tree)
    return found[0]


def _wrap(results: list):
    """Per-rank results put together: tensors as Ranks, anything else as rank 0's."""
    first = results[0]
    if isinstance(first, torch.Tensor):
        return Ranks(list(results))
    if isinstance(first, (tuple, list)):
        return type(first)(_wrap([r[i] for r in results]) for i in range(len(first)))
    return first


def tp_locals(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """A value as each of the n tp ranks holds it (a zoom's probe, verify/zoom/watch.py): a
    `Ranks`' local tensors; a tensor outside the region is every rank's."""
    return list(t.locals) if isinstance(t, Ranks) else [t] * n


def spread(t: torch.Tensor, n: int) -> Ranks:
    """A plain tensor (no gradient) as every rank's: tokens, masks, a buffer."""
    return t if isinstance(t, Ranks) else Ranks([t] * n)


# ---- collectives, in gloo's order -----------------------------------------------------------------
def _sum(values: list[torch.Tensor]) -> torch.Tensor:
    """The elementwise sum of one tensor per rank as gloo's all-reduce adds it."""
    if len(values) == 1:
        return values[0]
    return gloo_allreduce_sum([v.contiguous().reshape(-1) for v in values]).view_as(values[0])


class _AllReduce(torch.autograd.Function):
    """Partial -> Replicate: every rank gets the sum. Backward: the gradient stays as each rank
    holds it (DTensor keeps a replicated gradient replicated: `_redistribute_backward`)."""

    @staticmethod
    def forward(ctx, x: Ranks) -> Ranks:
        total = _sum(x.locals)
        return Ranks([total.clone() for _ in x.locals])

    @staticmethod
    def backward(ctx, g):
        return g


class _ReduceScatter(torch.autograd.Function):
    """Partial -> Shard(dim): rank r gets chunk r of the sum. Backward: the shards gathered (a
    sharded gradient back to the partial input becomes a replicated one: `_redistribute_backward`)."""

    @staticmethod
    def forward(ctx, x: Ranks, dim: int) -> Ranks:
        ctx.dim = dim
        return Ranks(_scatter_sum(x.locals, dim))

    @staticmethod
    def backward(ctx, g):
        g = spread(g, _n(g))
        whole = torch.cat(g.locals, dim=ctx.dim)
        return Ranks([whole.clone() for _ in g.locals]), None


def _scatter_sum(values: list[torch.Tensor], dim: int) -> list[torch.Tensor]:
    n = len(values)
    moved = [torch.cat(v.chunk(n, dim=dim), dim=0) for v in values]  # the chunks along dim 0
    total = _sum(moved)
    return [c.clone() for c in total.chunk(n, dim=0)]  # fresh, as a reduce-scatter's outputs are


class _AllGather(torch.autograd.Function):
    """Shard(dim) -> Replicate: every rank gets the shards concatenated. Backward: the gradient is
    partial (the gathered tensor feeds colwise linears, each rank's from its columns) and
    reduce-scattered back to the shards."""

    @staticmethod
    def forward(ctx, x: Ranks, dim: int) -> Ranks:
        ctx.dim = dim
        whole = torch.cat(x.locals, dim=dim)
        return Ranks([whole.clone() for _ in x.locals])

    @staticmethod
    def backward(ctx, g):
        g = spread(g, _n(g))
        return Ranks(_scatter_sum(g.locals, ctx.dim)), None


class _GatherOutput(torch.autograd.Function):
    """A colwise output, Shard(-1) -> Replicate. Backward: each rank keeps its chunk of its
    (replicated) gradient (Replicate -> Shard is a local chunk)."""

    @staticmethod
    def forward(ctx, x: Ranks) -> Ranks:
        whole = torch.cat(x.locals, dim=-1)
        return Ranks([whole.clone() for _ in x.locals])

    @staticmethod
    def backward(ctx, g):
        g = spread(g, _n(g))
        n = len(g.locals)
        return Ranks([loc.chunk(n, dim=-1)[r].contiguous() for r, loc in enumerate(g.locals)])


class _ChunkInput(torch.autograd.Function):
    """Replicate -> Shard(-1): rank r keeps chunk r. Backward: the sharded gradient gathered into a
    replicated one (Shard -> Replicate)."""

    @staticmethod
    def forward(ctx, x: Ranks) -> Ranks:
        n = len(x.locals)
        return _as_sharded_input([loc.chunk(n, dim=-1)[r].contiguous() for r, loc in enumerate(x.locals)])

    @staticmethod
    def backward(ctx, g):
        g = spread(g, _n(g))
        whole = torch.cat(g.locals, dim=-1)
        return Ranks([whole.clone() for _ in g.locals])


class _PartialInput(torch.autograd.Function):
    """A local replicated tensor taken as a DTensor (`from_local`, Replicate) by a colwise linear:
    identity; backward: each rank's partial gradient all-reduced (Partial -> Replicate)."""

    @staticmethod
    def forward(ctx, x: Ranks) -> Ranks:
        return Ranks(list(x.locals))

    @staticmethod
    def backward(ctx, g):
        g = spread(g, _n(g))
        total = _sum(g.locals)
        return Ranks([total.clone() for _ in g.locals])


class _FromLocal(torch.autograd.Function):
    """A local tensor taken as a DTensor (`DTensor.from_local`) where no collective follows:
    identity both ways, yet one autograd node, as DTensor's is. It groups the gradient sum: the
    module's own uses of its input (an RMSNorm reads `x.float()` twice) add up inside it before
    they meet the uses outside (the residual stream), as on the ranks. `rowwise`: a rowwise
    linear's input, carrying the DTensor's strides (`_as_sharded_input`)."""

    @staticmethod
    def forward(ctx, x: Ranks, rowwise: bool = False) -> Ranks:
        return _as_sharded_input(list(x.locals)) if rowwise else Ranks(list(x.locals))

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Enter(torch.autograd.Function):
    """A tensor from outside the region (the same on every tp rank) as each rank's copy; its
    gradient leaves as rank 0's (the ranks compute it alike: replicated)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int) -> Ranks:
        # the tensor itself on every rank, not a copy: a rank's input may be a view into its
        # batch (a sample at row 1 starts off a 16-byte boundary), which its first matmul sees
        return Ranks([x] * n)

    @staticmethod
    def backward(ctx, g):
        return (g.locals[0] if isinstance(g, Ranks) else g), None


class _Leave(torch.autograd.Function):
    """A replicated Ranks out of the region as rank 0's tensor; backward: the gradient is every
    rank's (each computes the same loss on the same values)."""

    @staticmethod
    def forward(ctx, x: Ranks) -> torch.Tensor:
        ctx.n = len(x.locals)
        return x.locals[0].clone()

    @staticmethod
    def backward(ctx, g):
        return Ranks([g.clone() for _ in range(ctx.n)])


class _FromLeaves(torch.autograd.Function):
    """A parameter as every tp rank's local tensor, from one leaf per rank (its shard, or a copy):
    each rank's gradient goes to its own leaf."""

    @staticmethod
    def forward(ctx, *leaves: torch.Tensor) -> Ranks:
        return Ranks([leaf.detach() for leaf in leaves])

    @staticmethod
    def backward(ctx, g):
        g = spread(g, _n(g))
        return tuple(g.locals)


class _Partition(torch.autograd.Function):
    """A replicated value every rank adds to a partial sum (a rowwise linear's bias): DTensor
    turns it Replicate -> Partial by dividing it by the ranks (`Partial._partition_value`), so
    the sum over the ranks adds it once; backward: the gradient as it comes (DTensor keeps it
    replicated), not divided."""

    @staticmethod
    def forward(ctx, x: Ranks) -> Ranks:
        n = len(x.locals)
        return Ranks([loc / n for loc in x.locals])

    @staticmethod
    def backward(ctx, g):
        return g


def _n(g) -> int:
    return len(g.locals) if isinstance(g, Ranks) else 1


def _as_sharded_input(locals: list[torch.Tensor]) -> Ranks:
    """A rowwise linear's input, Shard(-1) on every rank, with the strides autograd sees there.

    On the ranks autograd records the DTensor, whose strides are the global tensor's (torch's
    `compute_global_tensor_info`: a stride at or above the sharded dim's grows n-fold), and
    `mm_mat1_backward` picks its kernel by them: "column-major" (stride 1 first, then the rows)
    takes `(W^T g^T)^T`, anything else `g W`. A local input of one row and one feature is
    column-major by its own strides, never by the global ones, and the two kernels add the input
    gradient's dot product in different orders: 5 ulp in the layer below, 0.56x its bound and
    1.17x in Adam's squared average (fresh-seed sweep 20271101, case 468356afd158: the MLP,
    widths 1,2,27,6 at tp 2, one sample). So the wrapper carries the global strides; the local
    tensors, which the kernels run on, keep their own, as on the ranks."""
    first = locals[0]
    if first.dim() != 2:
        return Ranks(locals)
    n = len(locals)
    rows, cols = first.stride()
    return Ranks(locals, strides=(rows * n if rows >= cols else rows, cols))


# ---- the plan's styles on the reference model -----------------------------------------------------
@dataclass(frozen=True)
class Placement:
    """How a parameter lies over the tp ranks, and how its gradient leaves the region: "shard"
    (dim: each rank's chunk; the gradients concatenated), "partial" (replicated; each rank's
    gradient a partial sum, summed over the ranks: `combine`), "replicate" (replicated and
    computed alike everywhere: rank 0's), "partition" (a rowwise bias: replicated, each rank
    adding its 1/n share to its partial output, `_Partition`; the gradient rank 0's)."""

    kind: str
    dim: int = 0


REPLICATED = Placement("replicate")


def _layout(placement) -> tuple:
    """A torch Placement as this module's mark: ("shard", dim) or ("replicate",)."""
    from torch.distributed.tensor import Shard

    return ("shard", placement.dim) if isinstance(placement, Shard) else ("replicate",)


def _first(layouts):
    return layouts[0] if isinstance(layouts, tuple) else layouts


class TensorParallel:
    """The plan of a case, emulated on the reference model (`install`), and what a rank's pass
    does with the parameters and the loss (`split`, `loss`, `whole`, `gradients`)."""

    def __init__(self, case, model: nn.Module):
        from fsdp_verify.engines.tensor_parallel import plan_for

        self.case, self.n = case, case.tp
        self.plan = plan_for(case, model)
        self.placements = self._placements(model)
        self.inside = False  # in a rank's pass: the hooks run only there
        for fqn, style in self.plan.items():
            self._install(model.get_submodule(fqn), style)

    # ---- which parameter lies how
    def _placements(self, model: nn.Module) -> dict[str, Placement]:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

        out: dict[str, Placement] = {}
        for fqn, style in self.plan.items():
            module = model.get_submodule(fqn)
            for name, _ in module.named_parameters(recurse=False):
                full = f"{fqn}.{name}"
                embedding = isinstance(module, nn.Embedding)
                if isinstance(style, ColwiseParallel):
                    out[full] = Placement("shard", 1 if embedding else 0)
                elif isinstance(style, RowwiseParallel):
                    out[full] = Placement("shard", 0) if embedding else Placement("shard", 1)
                    if name == "bias":
                        out[full] = Placement("partition")
                elif isinstance(style, SequenceParallel):
                    out[full] = Placement("partial")
        return out

    def placement(self, name: str) -> Placement:
        return self.placements.get(name, REPLICATED)

    # ---- hooks: each style's inputs and outputs
    def _install(self, module: nn.Module, style) -> None:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
        )

        if isinstance(style, ColwiseParallel):
            self._hook(module, self._colwise_in(style), self._colwise_out(style))
        elif isinstance(style, RowwiseParallel):
            if isinstance(module, nn.Embedding):
                module.forward = self._embedding_forward(module, style)
            else:
                self._hook(module, self._rowwise_in(style), self._rowwise_out(style))
        elif isinstance(style, SequenceParallel):
            dim = style.sequence_sharding[0].dim
            self._hook(module, self._sequence_in(dim), self._mark_out(("shard", dim), style.use_local_output))
        elif isinstance(style, PrepareModuleInput):
            self._hook(module, self._prepare_in(style), None)
        else:
            raise NotImplementedError(f"the reference does not emulate {type(style).__name__}")

    def _hook(self, module: nn.Module, before, after) -> None:
        if before is not None:
            module.register_forward_pre_hook(
                lambda _m, args, kwargs: (before(args), kwargs) if self.inside else None, with_kwargs=True
            )
        if after is not None:
            # Before the unit's output cast, which the reference installed first: on the ranks the
            # plan's hooks come first and FSDP2 appends its post-forward (its pre-forward, the
            # input cast, is prepended: before the plan's, as the reference's is).
            module.register_forward_hook(lambda _m, _a, out: after(out) if self.inside else None, prepend=True)

    def _ranks(self, x) -> Ranks:
        return x if isinstance(x, Ranks) else _Enter.apply(x, self.n)

    def _colwise_in(self, style):
        given = _layout(_first(style.input_layouts))

        def before(args):
            x = self._ranks(args[0])
            if x.placement is not None:  # a DTensor already: redistributed where it must be
                x = _AllGather.apply(x, x.placement[1]) if x.placement[0] == "shard" else x
            elif given[0] == "shard":
                x = _AllGather.apply(x, given[1])
            else:
                x = _PartialInput.apply(x)
            return (x, *args[1:])

        return before

    def _colwise_out(self, style):
        wanted = _layout(_first(style.output_layouts))

        def after(out):
            if wanted[0] == "replicate":
                out = _GatherOutput.apply(out)
            return self._mark(out, wanted, style.use_local_output)

        return after

    def _rowwise_in(self, style):
        given = _layout(_first(style.input_layouts))

        def before(args):
            x = self._ranks(args[0])
            layout = x.placement or given
            if layout[0] == "replicate":
                x = _ChunkInput.apply(x)
            elif x.placement is None:
                x = _FromLocal.apply(x, True)
            return (x, *args[1:])

        return before

    def _rowwise_out(self, style):
        wanted = _layout(_first(style.output_layouts))

        def after(out):
            out = _ReduceScatter.apply(out, wanted[1]) if wanted[0] == "shard" else _AllReduce.apply(out)
            return self._mark(out, wanted, style.use_local_output)

        return after

    def _embedding_forward(self, module: nn.Embedding, style):
        """A vocabulary-sharded embedding (RowwiseParallel): rank r looks up the tokens in its rows
        (the others at row 0, zeroed: `_MaskPartial`), the partial outputs summed over the ranks."""
        wanted = _layout(_first(style.output_layouts))
        plain = module.forward

        def forward(tokens):
            if not self.inside:
                return plain(tokens)
            rows = module.num_embeddings // self.n
            tokens = tokens.locals[0] if isinstance(tokens, Ranks) else tokens
            masks, indices = [], []
            for r in range(self.n):
                mask = (tokens < r * rows) | (tokens >= (r + 1) * rows)
                masks.append(mask)
                indices.append((tokens - r * rows).masked_fill(mask, 0))
            local = F.embedding(Ranks(indices), module.weight)
            local = local.masked_fill(Ranks(masks).unsqueeze(-1), 0.0)
            out = _ReduceScatter.apply(local, wanted[1]) if wanted[0] == "shard" else _AllReduce.apply(local)
            return self._mark(out, wanted, style.use_local_output)

        return forward

    def _sequence_in(self, dim: int):
        def before(args):
            x = self._ranks(args[0])
            if x.placement is not None and x.placement != ("shard", dim):
                raise NotImplementedError("a SequenceParallel input in another layout is not emulated")
            return (x if x.placement is not None else _FromLocal.apply(x), *args[1:])

        return before

    def _prepare_in(self, style):
        layouts = style.input_layouts if isinstance(style.input_layouts, tuple) else (style.input_layouts,)
        desired = style.desired_input_layouts
        desired = desired if isinstance(desired, tuple) else (desired,)

        def before(args):
            out = list(args)
            for i, (given, want) in enumerate(zip(layouts, desired)):
                if given is None:
                    continue
                x = self._ranks(args[i])
                have, want = x.placement or _layout(given), _layout(want) if want is not None else None
                if want is not None and have != want:
                    if have[0] == "shard" and want[0] == "replicate":
                        x = _AllGather.apply(x, have[1])
                    else:
                        raise NotImplementedError(f"PrepareModuleInput {have} -> {want} is not emulated")
                out[i] = self._mark(x, want or have, style.use_local_output)
            return tuple(out)

        return before

    def _mark_out(self, layout: tuple, local: bool):
        return lambda out: self._mark(out, layout, local)

    @staticmethod
    def _mark(x: Ranks, layout: tuple, local: bool) -> Ranks:
        """`x` as the style leaves it: a local tensor, or a DTensor of `layout`."""
        x.placement = None if local else layout
        return x

    # ---- a rank's pass
    @contextlib.contextmanager
    def region(self):
        """The hooks on, for one rank's forward and backward."""
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def split(self, compute: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, list[torch.Tensor]]]:
        """The parameters as the tp ranks hold them (for `functional_call`) and the leaves the
        gradients are taken against: a sharded one's chunks, one copy a rank of the others."""
        params, leaves = {}, {}
        for name, p in compute.items():
            placement = self.placement(name)
            if placement.kind == "shard":
                # fresh tensors, as the ranks' local shards are: a view that starts off a 16-byte
                # boundary takes another BLAS path (a (1, 7) input through a colwise shard at row
                # offset 6 of a 7-wide weight: 1 ulp in 2 of 24 logits, measured)
                mine = [
                    c.detach().clone(memory_format=torch.contiguous_format)
                    for c in p.detach().chunk(self.n, dim=placement.dim)
                ]
            else:
                mine = [p.detach().clone() for _ in range(self.n)]
            mine = [m.requires_grad_(p.requires_grad) for m in mine]
            leaves[name] = mine
            params[name] = _FromLeaves.apply(*mine) if p.requires_grad else Ranks(mine)
            if placement.kind == "partition":
                params[name] = _Partition.apply(params[name])
        return params, leaves

    def gradients(self, names: list[str], grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """Each parameter's gradient from its leaves': a sharded one's concatenated, a partial
        one's stacked (one per tp rank, for `combine`), a replicated one's rank 0's."""
        out = []
        for name, mine in zip(names, grads):
            placement = self.placement(name)
            if placement.kind == "shard":
                out.append(torch.cat(mine, dim=placement.dim))
            elif placement.kind == "partial":
                out.append(torch.stack(mine))
            else:
                out.append(mine[0])
        return out

    def combine(self, rank_grads: list[dict[str, torch.Tensor]], reduce_dtype: torch.dtype) -> list[dict]:
        """Every partial gradient summed over its tp ranks in `reduce_dtype`, where FSDP2 reduces
        it before its own reduce-scatter (`_get_grad_inner_tensor`; after a no-sync micro-batch's
        accumulation, which holds it per rank)."""
        out = []
        for grads in rank_grads:
            mine = dict(grads)
            for name, g in grads.items():
                if self.placement(name).kind == "partial":
                    mine[name] = _sum([part.to(reduce_dtype) for part in g.unbind(0)])
            out.append(mine)
        return out

    def per_tp_rank(
        self, average: Callable[[list[dict[str, torch.Tensor]], int], dict[str, torch.Tensor]], rank_grads: list[dict]
    ) -> dict[str, torch.Tensor]:
        """The data-parallel reduction `average(local, t)` run on each tp rank t's local gradients,
        as FSDP2 reduce-scatters each rank's local shard over the data-parallel ranks (what it keeps
        between micro-batches, each rank its own), and the shards put back together."""
        sharded = {n for n in rank_grads[0] if self.placement(n).kind == "shard"}
        results = []
        for t in range(self.n):
            local = [
                {
                    n: g.chunk(self.n, dim=self.placement(n).dim)[t].contiguous() if n in sharded else g
                    for n, g in grads.items()
                }
                for grads in rank_grads
            ]
            results.append(average(local, t))
        out = dict(results[0])
        for n in sharded & set(out):
            out[n] = torch.cat([r[n] for r in results], dim=self.placement(n).dim)
        return out

    def norm(self, named: list[tuple[str, torch.Tensor]], shards: int) -> torch.Tensor:
        """The clip's total norm as torch 2.13's `clip_grad_norm_` computes it on FSDP2's 2-D
        gradients (measured bit-exact on (2, 2), (1, 2) and, with sequence parallelism, (3, 2)
        meshes; parameters off the tp mesh a group of their own, below): on each rank the norm of
        its local piece of each gradient (its tp piece's chunk of rows over the shard group); where
        some gradient is split over tp, `stack` makes every norm partial over tp, a replicated
        one's divided by sqrt(tp) there (`_NormPartial._partition_value`). The stacked norms are made whole over the shard group, then over tp,
        each as one all-reduce of the vector of squares in gloo's ring order
        (`squared_norms_reduced`), and the root; where no gradient is split, only the shard group
        reduces them. Then the norm of those. (Every parameter's squares in rank order over a
        shard group of 3 were an ulp off in one of four fresh seeds; tp 4 in rank order, 1 ulp in 3
        of a fresh-seed sweep's 300 cases.)"""
        from fsdp_verify.engines.tensor_parallel import tp_mesh_parameters

        mesh = tp_mesh_parameters(self.case)
        on = [(n, g) for n, g in named if n in mesh]
        off = [(n, g) for n, g in named if n not in mesh]
        if on and off:
            # A plan that leaves parameters off the tp mesh (a norm outside it, without sequence
            # parallelism): FSDP2 shards those over the data-parallel mesh alone, and the view clips
            # gradients of two meshes as torchtitan does (`EngineView.clip_grad_norm_`): each
            # mesh's norm whole, the total the root of their squares' sum (two add alike either way).
            return (self.norm(on, shards) ** 2 + self.norm(off, shards) ** 2) ** (1.0 / 2)
        spread = math.pow(self.n, 1 / 2.0)
        partial = any(self.placement(name).kind == "shard" for name, _ in named)
        # local[t][s]: the norms of tp rank t's pieces on shard rank s, one per parameter
        local: list[list[list[torch.Tensor]]] = [[[] for _ in range(shards)] for _ in range(self.n if partial else 1)]
        for name, g in named:
            placement = self.placement(name)
            split = placement.kind == "shard"
            pieces = g.chunk(self.n, dim=placement.dim) if split else [g] * len(local)
            for t, piece in enumerate(pieces):
                chunks = [c.clone() for c in piece.contiguous().chunk(shards, dim=0)] if g.dim() else [g]
                for s in range(shards):
                    n = chunks[s].norm() if s < len(chunks) else torch.zeros((), dtype=g.dtype)
                    local[t][s].append(n if split or not partial else n / spread)
        per_rank = [squared_norms_reduced([torch.stack(norms) for norms in row]) ** 0.5 for row in local]
        if not partial:
            return torch.linalg.vector_norm(per_rank[0])
        # the stacked norms all-reduced over tp at once: gloo's order over the vector
        totals = _sum([norms**2.0 for norms in per_rank]) ** 0.5
        return torch.linalg.vector_norm(totals)

    def whole(self, out) -> torch.Tensor:
        """The logits as recorded: a vocabulary-sharded output gathered, a replicated one rank 0's."""
        if not isinstance(out, Ranks):
            return out
        if out.placement == ("shard", out.dim() - 1) or out.placement == ("shard", -1):
            return torch.cat([loc.detach() for loc in out.locals], dim=-1)
        return out.locals[0].detach()

    def loss(self, case, out, targets: torch.Tensor, factor: float) -> torch.Tensor:
        """What the pass backpropagates: under loss parallelism the cross-entropy over the
        vocabulary shards, else the case's loss of the (replicated) output."""
        from fsdp_verify.training.data import IGNORE_INDEX
        from fsdp_verify.training.loss import microbatch_loss

        if isinstance(out, Ranks) and out.placement is not None and out.placement[0] == "shard":
            return vocab_parallel_cross_entropy(out, targets, IGNORE_INDEX) * factor
        return microbatch_loss(case, _Leave.apply(out) if isinstance(out, Ranks) else out, targets, factor)


# ---- loss parallelism ------------------------------------------------------------------------------
def vocab_parallel_cross_entropy(logits: Ranks, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The summed cross-entropy of logits sharded over the vocabulary (the last dim), as torch's
    `loss_parallel()` computes it: each rank's max all-reduced (MAX) and subtracted, its sum of
    exponentials all-reduced (SUM) and its log subtracted (`_log_softmax`); each target's log-
    probability taken on the rank that holds it, zero elsewhere, and all-reduced; the backward
    `(onehot(-1) + exp(log_softmax)) * grad` on each rank's columns (`_nll_loss_and_log_softmax_
    backward`), not autograd's `-grad + exp(...) * grad`. Returns the loss, a plain scalar."""
    return _VocabParallelCrossEntropy.apply(logits, targets, ignore_index)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Ranks, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        xs = [x.float().flatten(0, -2) for x in logits.locals]  # (items, vocab / n) on each rank
        t = targets.flatten()
        n, width = len(xs), xs[0].shape[-1]
        peak = torch.stack([x.amax(-1, keepdim=True) for x in xs]).amax(0)
        shifted = [x - peak for x in xs]
        sumexp = _sum([torch.sum(torch.exp(s), -1, keepdim=True) for s in shifted])
        logp = [s - torch.log(sumexp) for s in shifted]
        safe = torch.where(t != ignore_index, t, 0)
        picked = []
        for r in range(n):
            mask = (safe < r * width) | (safe >= (r + 1) * width)
            local = (safe - r * width).masked_fill(mask, 0)
            got = torch.gather(logp[r], 1, local.unsqueeze(1))
            picked.append(got.masked_fill(mask.unsqueeze(1), 0.0))
        result = -_sum(picked).squeeze(1)
        result = torch.where(t != ignore_index, result, 0)
        ctx.save_for_backward(*logp, t)
        ctx.meta = (ignore_index, width, logits.locals[0].shape, logits.locals[0].dtype)
        return result.sum()

    @staticmethod
    def backward(ctx, grad):
        *logp, t = ctx.saved_tensors
        ignore_index, width, shape, dtype = ctx.meta
        safe = torch.where(t != ignore_index, t, 0)
        grads = []
        for r, lp in enumerate(logp):
            mask = (safe < r * width) | (safe >= (r + 1) * width)
            local = (safe - r * width).masked_fill(mask, 0)
            onehot = torch.zeros_like(lp)
            onehot[torch.arange(local.shape[0]), local] = mask.to(lp.dtype) - 1.0
            g = torch.where((t != ignore_index).unsqueeze(1), grad, 0)
            grads.append(((onehot + torch.exp(lp)) * g).view(shape).to(dtype))
        return Ranks(grads), None, None
