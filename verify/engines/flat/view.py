"""FlatView: the EngineView of an engine that keeps each shard unit's parameters in one flat,
padded, rank-sharded buffer (FSDP1's FlatParameter, the bundled `flat` engine, yours).

Such an engine has no DTensors, so the loop cannot read full tensors off the parameters. What it
can say instead, on every rank, is what it *holds*: for each original parameter and each unit
that holds it, the contiguous slice of the flattened parameter that lies in this rank's shard
(possibly empty). That is a `Holding`.
Because a flat buffer is cut into rank-ordered contiguous chunks, the rank-ordered
concatenation of a parameter's slices is the flattened parameter: this view builds full params,
grads and optimizer state from that, in one collective per call (`gather_pieces`).

A parameter held by two units (seed 004: nested wrapping flattened it twice) is not hidden: its
first holding is the parameter (key: its FQN); the others are extra optimizer parameters keyed
"<fqn>@<unit>", they count in `param_sums` (so the sum doubles, as seed 004 saw) and the
ownership map lists both units.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_verify.engines.ownership import OwnershipMap, ParamOwnership
from fsdp_verify.engines.view import EngineView
from fsdp_verify.sharded.gather import _all_gather_single


@dataclass
class Holding:
    """What this rank holds of parameter `fqn` in shard unit `unit`."""

    fqn: str  # original FQN, as in the unsharded model
    unit: str  # the shard unit (the wrapped module's FQN; "" is the root)
    shape: tuple[int, ...]  # the full parameter's shape
    tensor: torch.Tensor  # this rank's slice, flattened (maybe empty): the tensor the optimizer steps


def _root_name(unit: str) -> str:
    return unit if unit else "<root>"


class FlatView(EngineView):
    """Subclasses say what this rank holds (`holdings`, same order on every rank) and how to
    switch gradient sync; everything else follows."""

    def __init__(self, module: torch.nn.Module, group: dist.ProcessGroup | None = None):
        super().__init__(module)
        self.group = group

    # ---- what the engine says ------------------------------------------------------------------
    def holdings(self) -> list[Holding]:
        raise NotImplementedError

    def set_requires_gradient_sync(self, sync: bool) -> None:
        raise NotImplementedError

    def checkpointer(self):
        """Whole tensors saved, each rank's piece loaded (verify/engines/flat/checkpoint.py):
        `get_state_dict` takes plain pieces for replicated tensors."""
        from fsdp_verify.engines.flat.checkpoint import FlatCheckpointer

        return FlatCheckpointer(self)

    def grad_scaler(self, spec, device: torch.device):
        """`ShardedGradScaler`: a flat engine's gradients are plain tensors, which
        `torch.amp.GradScaler` checks on this rank alone; this one all-reduces the found-inf
        flag (MAX) over the world, so every rank skips together (FSDP1's documented scaler)."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type, **spec.scaler_kwargs())

    # ---- derived ---------------------------------------------------------------------------------
    def _keyed(self) -> dict[str, Holding]:
        """The first holding of a parameter under its FQN, further ones under "<fqn>@<unit>"."""
        out: dict[str, Holding] = {}
        for h in self.holdings():
            out[h.fqn if h.fqn not in out else f"{h.fqn}@{_root_name(h.unit)}"] = h
        return out

    def _canonical(self) -> dict[str, Holding]:
        return {k: h for k, h in self._keyed().items() if k == h.fqn}

    def parameters(self) -> dict[str, torch.Tensor]:
        return {k: h.tensor for k, h in self._keyed().items()}

    def full_params(self) -> dict[str, torch.Tensor]:
        held = self._canonical()
        pieces = gather_pieces([h.tensor.detach() for h in held.values()], self.group)
        return {k: _join(p, h.shape) for (k, h), p in zip(held.items(), pieces)}

    def param_sums(self) -> dict[str, torch.Tensor]:
        """Sum of every element the engine holds for each FQN (all copies), from the local slices
        only: padding is never part of a slice, so it cannot leak in unless the engine put it
        there."""
        sums: dict[str, torch.Tensor] = {}
        for h in self.holdings():
            s = h.tensor.detach().double().sum()
            sums[h.fqn] = sums[h.fqn] + s if h.fqn in sums else s
        if not sums:
            return {}
        stacked = torch.stack(list(sums.values()))
        dist.all_reduce(stacked, group=self.group)
        return dict(zip(sums, stacked))

    def full_grads(self) -> dict[str, torch.Tensor]:
        held = {k: h for k, h in self._canonical().items() if h.tensor.requires_grad}
        pieces = gather_pieces([h.tensor.grad for h in held.values()], self.group)
        return {k: _join(p, h.shape) for (k, h), p in zip(held.items(), pieces) if any(x is not None for x in p)}

    def full_optimizer_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """State slices by "<param key>.<state key>". A rank that holds none of a parameter may
        have no state for it (FSDP1 leaves its grad None), so the keys are agreed first; scalar
        state (Adam's `step`) is replicated over the ranks that hold some of the parameter and
        taken from the first of them. A rank holding none keeps a `step` that never moves where
        the optimizer creates state up front (Adagrad: `step` 0 on every parameter)."""
        keyed = self._keyed()
        local = sorted((k, v.ndim == 0) for k, v in state.items())
        holds = {k for k, v in state.items() if v.ndim == 0 and keyed[k.rsplit(".", 1)[0]].tensor.numel()}
        everyone: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, (local, holds), group=self.group)
        keys = sorted({item for rank, _ in everyone for item in rank})
        pieces = gather_pieces([state.get(k) for k, _ in keys], self.group)
        out: dict[str, torch.Tensor] = {}
        for (key, scalar), parts in zip(keys, pieces):
            present = [p for p in parts if p is not None]
            if scalar:
                held = [p for p, (_, rank_holds) in zip(parts, everyone) if p is not None and key in rank_holds]
                out[key] = (held or present)[0].reshape(())
            else:
                out[key] = _join(parts, keyed[key.rsplit(".", 1)[0]].shape)
        return out

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global 2-norm: local sum of squares over everything held, summed over ranks; then the
        same coefficient as torch.nn.utils.clip_grad_norm_ (max_norm / (norm + 1e-6), at most 1)."""
        grads = [h.tensor.grad for h in self.holdings() if h.tensor.grad is not None]
        local = torch.zeros((), dtype=torch.float32)
        if grads:
            local = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) ** 2
        dist.all_reduce(local, group=self.group)
        total = local.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
        return total

    def ownership(self) -> OwnershipMap:
        """Every rank of the world reports its own holdings (the engine's own metadata),
        gathered in rank order: over the world, not the shard group, so that each replica's
        ranks are seen (FSDP1's hybrid and NO_SHARD meshes; the check reads them replica by
        replica). Padding is left unknown: in a flat buffer it belongs to the unit (its tail, and
        FSDP1's alignment gaps), not to any one parameter, so per parameter it has no meaning."""
        local = [(h.fqn, h.unit, h.shape, h.tensor.numel()) for h in self.holdings()]
        everyone: list[list] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, local)
        units: dict[str, list[str]] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        numel: dict[str, list[int]] = {}
        for rank, items in enumerate(everyone):
            for fqn, unit, shape, n in items:
                if unit not in units.setdefault(fqn, []):
                    units[fqn].append(unit)
                shapes[fqn] = tuple(shape)
                numel.setdefault(fqn, [0] * len(everyone))[rank] += n
        params = {fqn: ParamOwnership(fqn, tuple(units[fqn]), shapes[fqn], tuple(numel[fqn])) for fqn in units}
        return OwnershipMap(params=params, unmanaged=self.unmanaged())

    def unmanaged(self) -> tuple[str, ...]:
        """Parameters of the module that no unit holds (plain, replicated)."""
        return ()


def _join(parts: list[torch.Tensor | None], shape: tuple[int, ...]) -> torch.Tensor:
    return torch.cat([p for p in parts if p is not None]).view(shape)


# ---- one collective for many ragged pieces ----------------------------------------------------------
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8)


def gather_pieces(pieces: list[torch.Tensor | None], group: dist.ProcessGroup | None = None) -> list[list]:
    """Every rank's piece of every item: `out[i][r]` is rank r's `pieces[i]`, flattened, or None
    where rank r had none. Sizes and dtypes travel in a first small all-gather, the bytes of all
    pieces in a second one: bit-exact whatever the dtype, two collectives whatever the count."""
    world = dist.get_world_size(group)
    device = next((p.device for p in pieces if p is not None), torch.device("cpu"))
    meta = torch.tensor(
        [[-1, 0] if p is None else [p.numel(), _DTYPES.index(p.dtype)] for p in pieces], dtype=torch.int64
    ).reshape(-1, 2)
    metas = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(metas, meta, group=group)
    layouts = [[(n, _DTYPES[c]) for n, c in m.tolist()] for m in metas]
    sizes = [sum(n * d.itemsize for n, d in lay if n > 0) for lay in layouts]
    size = max(sizes)
    recv = torch.zeros(world, size, dtype=torch.uint8, device=device)
    if size:
        own = [p.detach().contiguous().reshape(-1).view(torch.uint8) for p in pieces if p is not None]
        send = torch.zeros(size, dtype=torch.uint8, device=device)
        if own:
            flat = torch.cat(own)
            send[: flat.numel()] = flat
        _all_gather_single(recv.view(-1), send, group=group)
    out: list[list] = [[None] * world for _ in pieces]
    for r, lay in enumerate(layouts):
        offset = 0
        for i, (n, dtype) in enumerate(lay):
            if n < 0:
                continue
            nbytes = n * dtype.itemsize
            out[i][r] = recv[r, offset : offset + nbytes].view(dtype).clone()
            offset += nbytes
    return out
