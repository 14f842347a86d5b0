"""Saving and loading an engine whose parameters are flat pieces (`FlatView`: the bundled flat
engine, yours), with `torch.distributed.checkpoint` (docs/resume.md).

Such an engine's parameters are its shard views: plain 1-D tensors, of another length on each
rank (maybe empty), with nothing that tells DCP they are pieces of one tensor. `get_state_dict`
hands them over as they are and DCP takes a plain tensor for a replicated one, keeping one rank's
copy: the other ranks' pieces were lost, and a load refused the size ("saved torch.Size([10]) and
current: torch.Size([6])" at the same world size; resumed on one rank, a rank that held no
element of a parameter had saved an empty momentum buffer: "saved torch.Size([0]) and current:
torch.Size([1])", issue 37).

So the checkpoint holds each parameter and each optimizer state tensor whole, in the parameter's
shape, under the keys of the flattened state dicts `get_state_dict` makes for FSDP2
(`model.<fqn>`, `optim.state.<fqn>.<entry>`, `optim.param_groups.<fqn>.<hyperparameter>`):
gathered on every rank to save (DCP writes one copy of a tensor every rank holds alike) and read
whole on every rank to load, each rank keeping the piece its shard holds. A rank's piece starts
where the pieces of the ranks before it end (the rank-ordered concatenation of a parameter's
pieces is the flattened parameter, verify/engines/flat/view.py). That reshards to any world size,
whatever a rank holds, nothing included. The cost is the whole model and optimizer state on
every rank for the moment of a save or load: fine for the models a check runs, not for a model
that needs sharding to fit (FSDP1's sharded state dict is that engine's own, `FSDP1View`).

Only the state the optimizer has is saved: a parameter it never stepped (frozen, or every step
skipped by the loss scaler) has none, and gets none on load, as in the run that never stopped
(no zero-gradient step is made up, unlike `get_state_dict`: verify/training/resume.py). The
layout is FSDP2's, and so are the `trainer.stepped.<fqn>` marks: FSDP2 resumes from a flat
engine's checkpoint and the flat engine from FSDP2's (its made-up state left out by the marks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fsdp_verify.training.optim import optimizer_state
from fsdp_verify.training.resume import Checkpointer, saved_template, stepped_marks, unstepped_state_key

if TYPE_CHECKING:
    from fsdp_verify.engines.flat.view import FlatView


class FlatCheckpointer(Checkpointer):
    def __init__(self, view: FlatView):
        super().__init__(view.module)
        self.view = view

    def save(self, path: str, optimizer: torch.optim.Optimizer, trainer: dict[str, torch.Tensor]) -> None:
        params = self.view.parameters()
        state = self.view.full_optimizer_state(optimizer_state(optimizer, params))
        optim: dict = {f"state.{key}": value for key, value in state.items()}
        names = {id(p): key for key, p in params.items()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                for hyper, value in group.items():
                    if hyper != "params":
                        optim[f"param_groups.{names[id(p)]}.{hyper}"] = value
        trainer = {**trainer, **stepped_marks(self.module, optimizer)}  # what an FSDP2 load reads
        dcp.save({"model": self.view.full_params(), "optim": optim, "trainer": trainer}, checkpoint_id=path)

    def load(self, path: str, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        saved = saved_template(path)
        dcp.load(saved, checkpoint_id=path)
        model, optim = saved["model"], saved["optim"]
        params = self.view.parameters()
        starts = piece_starts(self.view)
        with torch.no_grad():
            for key, piece in params.items():
                piece.copy_(_piece(model[key.split("@")[0]], starts[key], piece.numel()))
        optimizer.state.clear()
        for key, piece in params.items():
            prefix = f"state.{key}."
            entries = {
                k.removeprefix(prefix): v
                for k, v in optim.items()
                if k.startswith(prefix) and not unstepped_state_key(k, saved["trainer"])  # FSDP2's made-up state
            }
            if entries:  # a scalar (Adam's `step`) is the parameter's, whole; a tensor, this rank's piece
                optimizer.state[piece] = {
                    name: v.clone() if v.dim() == 0 else _piece(v, starts[key], piece.numel()).to(piece.device)
                    for name, v in entries.items()
                }
        names = {id(p): key for key, p in params.items()}
        for group in optimizer.param_groups:
            key = names[id(group["params"][0])]
            for hyper in group:
                if hyper != "params":
                    group[hyper] = optim[f"param_groups.{key}.{hyper}"]
        return self.after_load(optimizer, saved["trainer"])


def _piece(whole: torch.Tensor, start: int, numel: int) -> torch.Tensor:
    return whole.reshape(-1)[start : start + numel].clone()


def piece_starts(view: FlatView) -> dict[str, int]:
    """Where this rank's piece of each parameter (as `view.parameters()` keys it) starts in the
    flattened parameter: after the pieces of the ranks before it in the view's group (a
    collective: one all-gather of the lengths)."""
    params = view.parameters()
    device = next((p.device for p in params.values()), torch.device("cpu"))
    mine = torch.tensor([p.numel() for p in params.values()], dtype=torch.int64, device=device)
    world, rank = dist.get_world_size(view.group), dist.get_rank(view.group)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=view.group)
    before = sum(everyone[:rank], torch.zeros_like(mine))
    return dict(zip(params, before.cpu().tolist()))
