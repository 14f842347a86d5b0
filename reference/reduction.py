"""How the emulated ranks' gradients become one: summed in gloo's ring order along each unit's
shards (`average`), HSDP's reduce-scatter then all-reduce (`hsdp_average`), a flat-buffer engine's
layout (`FlatLayout`), the divide factors, and a clip's norm from the shards' norms as FSDP2
computes it (`norm_from_shards`). The arithmetic each engine declares (verify/engines/arithmetic.py)
picks among them."""

from __future__ import annotations

import torch
from torch import nn

from fsdp_verify.case import Case
from fsdp_verify.dtypes import to_torch
from fsdp_verify.engines.arithmetic import Arithmetic, gloo_allreduce_sum, gloo_scalar_sum, squared_norms_reduced
from fsdp_verify.engines.placement import shard_dim
from fsdp_verify.units import owner_of_param


def average(
    grads: list[torch.Tensor], reduce_dtype: torch.dtype, order: str, divide: tuple[float, float] | None = None
) -> torch.Tensor:
    """ReduceOp.AVG per parameter: upcast to reduce_dtype, sum, divide by the world size. The
    calibration runs' orders ("rank", "reverse"), and "ring" where the reference does not emulate
    every rank; FSDP2's own reduction, every rank emulated, is `hsdp_average` (any mesh).

    "ring": FSDP2 shards every parameter by rows (dim 0, chunks of ceil(rows / W)), and gloo's
    ring reduce-scatter adds the contributions to the rows that rank r owns in the order r-1,
    r-2, ..., r+1 and then r, except where gloo's segments of the unit's whole buffer cross a
    rank's rows: there a neighbour's order applies (`hsdp_average` follows the segments; this
    per-row model was 0.041x off on an MLP at 3 ranks). NCCL's order on GPUs is left to the
    calibrated tolerance.

    `divide` = (pre, post): each rank's gradient divided by `pre` before the sum and the sum by
    `post` after it (`Arithmetic.divide_factors`; FSDP2 pre-divides an fp16 reduction, whose sum
    could overflow); default: sum, then divide by the world size."""
    world = len(grads)
    pre, post = divide if divide is not None else (1.0, float(world))
    wide = [g.to(reduce_dtype) for g in grads]
    if world == 1:
        return wide[0]
    if pre != 1:
        wide = [g / pre for g in wide]
    if order == "rank":
        sequences = [(slice(None), list(range(world)))]
    elif order == "reverse":
        sequences = [(slice(None), list(range(world))[::-1])]
    else:
        chunk = -(-wide[0].shape[0] // world) if wide[0].dim() else 1
        sequences = [
            (slice(r * chunk, (r + 1) * chunk), [(r - k) % world for k in range(1, world)] + [r]) for r in range(world)
        ]
    total = torch.empty_like(wide[0])
    for rows, ranks in sequences:  # in place: the same elementwise additions, without temporaries
        acc = total[rows]
        torch.add(wide[ranks[0]][rows], wide[ranks[1]][rows], out=acc)
        for r in ranks[2:]:
            acc.add_(wide[r][rows])
    return total.div_(post) if post != 1 else total


def hsdp_average(
    rank_grads: list[dict[str, torch.Tensor]],
    case: Case,
    reduce_dtype: torch.dtype,
    divide: tuple[float, float],
    partial: dict[str, list[torch.Tensor]] | None = None,
    all_reduce: bool = True,
    staged: bool | None = None,
) -> dict[str, torch.Tensor]:
    """ReduceOp.AVG as FSDP2 issues it on a 2-D (R, S) mesh, which it always runs as HSDP
    (`foreach_reduce`), per unit: each rank's gradients copied into one (S, n) buffer, row s the
    unit's row chunks s (`_chunk_cat`); reduce-scattered over each replica's S ranks (global rank
    i * S + s), which gloo adds as its all-reduce of the whole buffer (`gloo_allreduce_sum`, as
    for FSDP1's flat buffers); each row then all-reduced over the R replicas
    (`_replica_all_reduce`). Its divide factors (`_get_gradient_divide_factors`): an fp32 or bf16
    reduction is AVG in both collectives, the sum over S divided by S in reduce_dtype and the sum
    over R by R (not the sum of R * S divided by the world once: other roundings unless R and S
    are powers of two); an fp16 one pre-divides by `pre` and SUMs both, then divides by `post`
    (`Arithmetic.divide_factors` of the whole world). (W, 1): the reduce-scatter of one rank is a
    copy and the all-reduce does it all; (1, W): the reduce-scatter alone, and so a 1-D mesh of W,
    whose reduce-scatter gloo adds the same way: by segments of the whole buffer, not by each
    parameter's row chunks as `average`'s ring assumed (that missed gloo's segment boundaries:
    the default MLP at 3 ranks with a clip and Adam was 0.041x off uncalibrated, now exact).

    `partial` (`replica_sync_last`): a micro-batch without the all-reduce (`all_reduce=False`)
    adds each replica's reduce-scattered rows into `partial[unit]` in reduce_dtype and gives no
    gradient (FSDP2's `foreach_reduce` returns before the post-divide and the copy-out); the
    micro-batch that all-reduces adds `partial` into its own rows first (`reduce_output +=
    partial_reduce_output`), then all-reduces the sum."""
    replicas, shards = case.mesh if len(case.mesh) == 2 else (1, case.dp_size)  # a 1-D mesh: (1, W)
    pre, post = divide
    # AVG in each collective (FSDP2's fp32/bf16); else SUM, SUM, post-divide; (1, 1): SUM, SUM and
    # nothing divided (`grad_reduction: sum`, or one rank, where neither collective has two ranks)
    # `staged=False`: a unit whose divide factor is set, its sum forced (expert parallelism's
    # experts: reference/expert_parallel.py): SUM, SUM, then `post`.
    staged = pre == 1 and post != 1 if staged is None else staged
    units: dict[str, list[str]] = {}
    for n in rank_grads[0]:
        units.setdefault(owner_of_param(case.wrap_plan, n), []).append(n)
    out: dict[str, torch.Tensor] = {}
    for names in units.values():
        dims = [placement_dim(case, n, rank_grads[0][n].shape) for n in names]
        bufs = [_chunk_cat([g[n] for n in names], shards, reduce_dtype, dims) for g in rank_grads]
        if pre != 1:
            bufs = [b / pre for b in bufs]
        per_replica = []
        for i in range(replicas):
            group = [b.reshape(-1) for b in bufs[i * shards : (i + 1) * shards]]
            summed = gloo_allreduce_sum(group).view(shards, -1)
            per_replica.append(summed.div_(shards) if staged and shards != 1 else summed)
        if partial is not None:
            unit = owner_of_param(case.wrap_plan, names[0])
            kept = partial.pop(unit, None)
            if kept is not None:
                per_replica = [mine + earlier for mine, earlier in zip(per_replica, kept)]
            if not all_reduce:
                partial[unit] = per_replica
                continue
        total = _replica_all_reduce(per_replica)
        last = float(replicas) if staged else post
        total = total / last if last != 1 else total
        offset = 0
        for n, dim in zip(names, dims):
            shape = rank_grads[0][n].shape
            if dim:  # Shard(1): rank s's block is the dim-1 chunk s, (rows, cols / S) flattened
                numel = rank_grads[0][n].numel() // shards
                block = total[:, offset : offset + numel].reshape(shards, shape[0], -1, *shape[2:])
                out[n] = torch.cat(block.unbind(0), dim=1)
                offset += numel
                continue
            rows = shape[0] if len(shape) else 1
            chunk, width = -(-rows // shards), max(rank_grads[0][n].numel() // max(rows, 1), 1)
            block = total[:, offset : offset + chunk * width].reshape(shards * chunk, width)
            out[n] = block[:rows].reshape(shape)
            offset += chunk * width
    return out


def divide_factors(case: Case, arithmetic: Arithmetic, reduce_dtype: torch.dtype, world: int) -> tuple[float, float]:
    """(pre, post) of the engine's reduction (`Arithmetic.divide_factors`); `grad_reduction: sum`
    divides nothing: FSDP2 with `set_gradient_divide_factor(1.0)` (and gloo's forced SUM) sums
    in both collectives, its pre and post factors 1 in every dtype (`_get_gradient_divide_factors`
    of torch 2.13), and `_div_if_needed` skips a factor of 1."""
    if case.grad_reduction == "sum":
        return 1.0, 1.0
    return arithmetic.divide_factors(reduce_dtype, world)


def placement_dim(case: Case, name: str, shape) -> int:
    """The dim FSDP2 shards parameter `name` on (`case.shard_placement`, verify/engines/placement.py)."""
    return shard_dim(case.shard_placement, name, tuple(shape), case.mesh[-1])


def _chunk_cat(
    grads: list[torch.Tensor], shards: int, dtype: torch.dtype, dims: list[int] | None = None
) -> torch.Tensor:
    """FSDP2's reduce-scatter input (`foreach_reduce_scatter_copy_in`): each gradient's rows
    padded with zeros to S equal chunks (ceil(rows / S) each), row s of the (S, n) result the
    chunks s of every gradient, flattened and concatenated in the unit's order. A Shard(1)
    gradient (`dims`) is first cut in S chunks along dim 1 and those stacked along dim 0
    (`foreach_reduce`, before the copy-in): row s holds its dim-1 chunk s."""
    pieces = []
    for i, g in enumerate(grads):
        if dims is not None and dims[i] and shards > 1:
            pieces.append(torch.stack(g.to(dtype).chunk(shards, dim=1)).reshape(shards, -1))
            continue
        rows = g.reshape(g.shape[0] if g.dim() else 1, -1)
        chunk = -(-rows.shape[0] // shards)
        padded = torch.zeros(chunk * shards, rows.shape[1], dtype=dtype)
        padded[: rows.shape[0]] = rows
        pieces.append(padded.view(shards, -1))
    return torch.cat(pieces, dim=1)


class FlatLayout:
    """Each unit's parameters flattened as a FlatParameter engine lays them out: registration
    order (frozen ones too, their gradient zero), each start aligned to `align_bytes` of the
    compute dtype, the whole padded to a multiple of the shard group's size and cut into equal
    chunks, chunk r held by rank r of each shard group (of the mesh's last dimension: the world,
    or FSDP1's hybrid shard group, or one rank under NO_SHARD), the same on every replica."""

    def __init__(self, model: nn.Module, case: Case, arithmetic: Arithmetic):
        self.world = case.mesh[-1]  # the shard group
        self.replicas = case.dp_size // self.world
        params = dict(model.named_parameters())  # tied weights once, under their first name
        by_unit: dict[str, list[str]] = {}
        for n in params:
            by_unit.setdefault(owner_of_param(case.wrap_plan, n), []).append(n)
        if arithmetic.unit_order == "preorder":
            position = {name: i for i, (name, _) in enumerate(model.named_modules())}
            order = sorted(by_unit, key=lambda u: position[u])
        else:
            order = [u for u in case.wrap_plan if u in by_unit]
        itemsize = (to_torch(case.precision.param_dtype) or torch.float32).itemsize
        align = arithmetic.align_bytes // itemsize if arithmetic.align_bytes else 0
        self.carries = arithmetic.no_shard_reduces_running_sum and self.world == 1
        self.empty_pieces = arithmetic.empty_pieces_in_norm
        self.plain_unsharded = arithmetic.plain_norm_unsharded
        self.params = params  # which ones train is read when needed: a case may unfreeze some
        self.shapes = {n: p.shape for n, p in params.items()}
        # units[i] = ([(name, offset, numel)], padded numel)
        self.units: list[tuple[list[tuple[str, int, int]], int]] = []
        for unit in order:
            slots, total = [], 0
            for n in by_unit[unit]:
                if align and total % align:
                    total += align - total % align
                slots.append((n, total, params[n].numel()))
                total += params[n].numel()
            self.units.append((slots, -(-total // self.world) * self.world))

    def compute(self, params: dict[str, nn.Parameter], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The compute copies of `params` in `dtype`, each a leaf that aliases its slot of a
        buffer per unit laid out as the engine's (`Arithmetic.computes_on_flat_views`): the same
        alignment, so the same kernels add in the same order. Frozen slots are filled too, as the
        engine gathers them."""
        compute: dict[str, torch.Tensor] = {}
        for slots, padded in self.units:
            buffer = torch.zeros(padded, dtype=dtype)
            for n, offset, numel in slots:
                p = params[n]
                view = buffer[offset : offset + numel]
                view.copy_(p.detach().reshape(-1))  # the cast .to(dtype) does: round to nearest
                compute[n] = view.view(p.shape).detach().requires_grad_(p.requires_grad)
        return compute

    def _flat(self, grads: dict[str, torch.Tensor], slots, padded: int, dtype: torch.dtype) -> torch.Tensor:
        flat = torch.zeros(padded, dtype=dtype)
        for n, offset, numel in slots:
            if n in grads:
                flat[offset : offset + numel] = grads[n].reshape(-1).to(dtype)
        return flat

    def average(
        self,
        rank_grads: list[dict[str, torch.Tensor]],
        reduce_dtype: torch.dtype,
        divide: tuple[float, float] | None = None,
    ) -> dict[str, torch.Tensor]:
        """ReduceOp.AVG as the engine issues it: per unit, the padded flat gradients reduce-
        scattered in equal chunks over each shard group in gloo's order (`gloo_allreduce_sum`), the
        shards all-reduced over the replicas (`_replica_all_reduce`), each rank's gradient
        divided by `pre` before and the sum by `post` after (`Arithmetic.divide_factors`:
        FSDP1's power-of-two pre-divide is exact but for subnormals, and keeps an fp16 sum from
        overflowing)."""
        pre, post = divide if divide is not None else (1.0, float(len(rank_grads)))
        out: dict[str, torch.Tensor] = {}
        for slots, padded in self.units:
            names = [n for n, _, _ in slots if n in rank_grads[0]]
            if not names:
                continue
            chunk = padded // self.world
            flats = [self._flat(g, slots, padded, reduce_dtype).view(self.world, chunk) for g in rank_grads]
            if pre != 1:
                flats = [f / pre for f in flats]
            # Rank i * shards + s holds shard s of replica i. gloo's reduce-scatter adds as its
            # all-reduce does (`gloo_allreduce_sum`: rank r's segments in the order r-1, ..., r),
            # with segment boundaries a few elements off the chunks' (measured on torch 2.13 for
            # fp32 and bf16 at 3 and 4 ranks; the per-chunk ring order missed 1 to 3 elements).
            per_replica = []
            for i in range(self.replicas):
                group = [f.reshape(-1) for f in flats[i * self.world : (i + 1) * self.world]]
                per_replica.append(gloo_allreduce_sum(group).view_as(flats[0]))
            total = _replica_all_reduce(per_replica)
            averaged = (total / post).reshape(-1) if post != 1 else total.reshape(-1)
            for n, offset, numel in slots:
                if n in rank_grads[0]:
                    out[n] = averaged[offset : offset + numel].view(rank_grads[0][n].shape)
        for n in rank_grads[0]:  # a gradient no slot holds (a pipeline's second copy of a tie): on its own
            if n not in out:
                out[n] = average([g[n] for g in rank_grads], reduce_dtype, "rank", (pre, post))
        return out

    def carry(
        self, rank_grads: list[dict[str, torch.Tensor]], master_grads: dict[str, torch.Tensor]
    ) -> list[dict[str, torch.Tensor]]:
        """What each rank reduces on a synced micro-batch when the engine reduces the running sum
        (`Arithmetic.no_shard_reduces_running_sum`: FSDP1's NO_SHARD, a shard group of one):
        the earlier micro-batches' reduced gradient plus this rank's new one, added in fp32 as
        autograd adds the new gradient into the FlatParameter's fp32 .grad. Their reduction
        replaces that sum, so it is taken out of `master_grads`. Sharded strategies keep the
        reduced shard aside and add the next one after its reduction, as `master_grads` does:
        nothing to carry."""
        if not self.carries or not master_grads:
            return rank_grads
        carried = [
            {n: master_grads[n] + g if n in master_grads else g for n, g in grads.items()} for grads in rank_grads
        ]
        for n in rank_grads[0]:
            master_grads.pop(n, None)
        return carried

    def norm(self, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        """The clip's total norm as a flat engine computes it: on each rank, the norm of the
        norms of the pieces of each gradient in its chunk, squared; summed over the ranks in
        rank order; the root."""
        if self.world == 1 and self.plain_unsharded:
            return torch.nn.utils.get_total_norm([g for n, g in grads.items() if self.params[n].requires_grad])
        squares = []
        for r in range(self.world):
            pieces = []
            for slots, padded in self.units:
                chunk = padded // self.world
                lo, hi = r * chunk, (r + 1) * chunk
                for n, offset, numel in slots:
                    if n not in grads or not self.params[n].requires_grad:
                        continue
                    a, b = max(lo, offset) - offset, min(hi, offset + numel) - offset
                    if a < b:
                        pieces.append(torch.linalg.vector_norm(grads[n].reshape(-1)[a:b]))
                    elif self.empty_pieces:
                        pieces.append(torch.linalg.vector_norm(grads[n].reshape(-1)[:0]))
            local = torch.linalg.vector_norm(torch.stack(pieces)) if pieces else torch.zeros(())
            squares.append(local**2)
        return gloo_scalar_sum(squares).sqrt()


def _replica_all_reduce(per_replica: list[torch.Tensor]) -> torch.Tensor:
    """FSDP1's all-reduce over the replicas, of each shard group's reduce-scattered (S, chunk)
    flat gradient: HYBRID_SHARD all-reduces each rank's chunk over its replicate group, NO_SHARD
    (S = 1) the whole flat gradient over every rank, both in gloo's ring order
    (`gloo_allreduce_sum`). The whole average is then post-divided once, as FSDP1 does after the
    all-reduce; one replica: nothing to add."""
    if len(per_replica) == 1:
        return per_replica[0]
    rows = per_replica[0].shape[0]
    return torch.stack([gloo_allreduce_sum([t[s] for t in per_replica]) for s in range(rows)])


def norm_from_shards(grads: list[torch.Tensor], world: int, dims: list[int] | None = None) -> torch.Tensor:
    """The global norm as FSDP2's `clip_grad_norm_` computes it on DTensors (`get_total_norm`):
    on each rank, the norm of its row chunk of every gradient (`_foreach_norm`, each partial over
    the shard group); `stack` keeps them partial, and `vector_norm` first makes that vector whole:
    one all-reduce of every rank's vector of squares, added as gloo's ring adds a vector
    (`squared_norms_reduced`), the root of each; then the norm of those norms. It differs from one
    norm of the full gradient by an ulp or two, which moves the clip coefficient of every
    gradient alike, and a strongly conditioned case (data scale 100, AdamW) turns that into a
    1.5e-6 deviation of the next step's logits. Bit-exact against FSDP2 on gloo at world sizes 2
    to 4; at 3 and 4 each element is added in the order of the ring segment it falls in, which a
    sum in rank order for every parameter missed by an ulp in some steps (a clip beside ep at
    world size 4, step 3; a torchtitan (1, 4) case of sweep seed 5004 whose one-ulp norm Adam
    grew to 0.498 of the parameters' tolerance). On an HSDP mesh (R, S) a gradient is Replicate
    on the replicas and Shard(0) over the S ranks of a shard group: `world` is S. A Shard(1)
    parameter (`dims`): its dim-1 chunks."""
    per_rank = [[] for _ in range(world)]
    for i, g in enumerate(grads):
        dim = dims[i] if dims is not None else 0
        # A Shard(1) shard is a contiguous (rows, cols / S) tensor on its rank: its norm reduces
        # in that layout's order, not a strided view's (1 ulp apart at 3 ranks).
        chunks = g.chunk(world, dim=dim) if g.dim() else [g]
        zero = torch.zeros((), dtype=g.dtype)
        for r in range(world):
            per_rank[r].append(chunks[r].contiguous().norm() if r < len(chunks) else zero)
    return torch.linalg.vector_norm(squared_norms_reduced([torch.stack(norms) for norms in per_rank]).sqrt())
