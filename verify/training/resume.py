"""A checkpoint and resume with the real APIs (docs/resume.md): `torch.distributed.checkpoint`
(DCP) with `get_state_dict` / `set_state_dict`, resharded on load to whatever world size, mesh
and engine the resumed run has.

What a resume must carry beyond the model and the optimizer (Adam's moments and its scalar
`step`, the lr in its param groups) is the trainer's state: the step it stopped after, the data
position (how many global batches were consumed), every rank's dropout generator, the loss
scaler's scale and good-step count, and the lr schedule's position. It travels in the same
checkpoint as plain tensors under `trainer.*` (replicated: DCP keeps one copy).

A resumed rank r takes the generator state saved by rank r; a rank the saving run did not have
starts from its own fresh seed (`dropout_seed`), as the reference's replay of it does
(reference/trainer.py `_Run.resumed`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from fsdp_verify import module_names
from fsdp_verify.training.optim import schedule_state
from fsdp_verify.training.rng import rng_fingerprint

# What torch says on every FSDP1 save and load (its sharded state dict goes through ShardedTensor,
# which torch deprecates): nothing about the run, and a screen of it a case.
_FSDP1_NOISE = (
    "Please use DTensor instead",
    "`_get_pg_default_device` will be deprecated",
    "Multiple backends are registered",
    "When using ``NO_SHARD`` for ``ShardingStrategy``",
)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        for message in _FSDP1_NOISE:
            warnings.filterwarnings("ignore", message=".*" + message.replace("`", "."))
        yield


# The optimizer's state dict flat (`state.<fqn>.<key>`, `param_groups.<fqn>.<key>`): FSDP1 at
# world size 3 saved its nested `param_groups` list as one value on some ranks and flattened on
# others, and a load then missed the key `optim.param_groups` (sweep seed 20262904, 2 of 80).
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class Checkpointer:
    """Saves and loads one engine's model and optimizer plus the trainer's state. Every method is
    a collective. The zoo's resume mutants (verify/zoo/mutants/) override one step of `load`."""

    def __init__(self, module: nn.Module):
        self.module = module

    def save(self, path: str, optimizer: torch.optim.Optimizer, trainer: dict[str, torch.Tensor]) -> None:
        trainer = {**trainer, **stepped_marks(self.module, optimizer)}  # before get_state_dict makes state
        with _quiet():
            model_sd, optim_sd = get_state_dict(self.module, optimizer, options=OPTIONS)
            dcp.save({"model": model_sd, "optim": optim_sd, "trainer": trainer}, checkpoint_id=path)

    def load(self, path: str, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """Model and optimizer loaded into this run's sharding (DCP reshards on read); returns
        the trainer's state."""
        with _quiet():
            return self._load(path, optimizer)

    def _load(self, path: str, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        model_sd, optim_sd = get_state_dict(self.module, optimizer, options=OPTIONS)  # a fresh optimizer's, initialised
        trainer = trainer_template(path)
        dcp.load({"trainer": trainer}, checkpoint_id=path)  # first: which parameters were stepped
        state = {"model": self.rename(model_sd)}
        to_read = {k: v for k, v in optim_sd.items() if not unstepped_state_key(k, trainer)}
        if to_read:  # empty on an FSDP1 rank that holds no element of any parameter: nothing to read
            state["optim"] = to_read
        dcp.load(state, checkpoint_id=path, planner=self.planner())
        # Tensors are read in place; other values (a param group's `lr`, ...) are put into the
        # dict read, so into `optim_sd` by hand (a schedule's lr was lost without this).
        optim_sd.update(to_read)
        frozen = {p: st for p, st in optimizer.state.items() if not p.requires_grad and st}
        self.set(optimizer, state["model"], optim_sd)
        for p, st in frozen.items():  # dropped by set_state_dict: see `Checkpointer.frozen_state`
            optimizer.state.setdefault(p, st)
        forget_unstepped_state(self.module, optimizer, trainer)
        return self.after_load(optimizer, trainer)

    # `set_state_dict` loads optimizer state only for parameters that require grad (torch 2.13
    # `_load_optim_state_dict`) and replaces the optimizer's state whole, so the state a frozen
    # parameter has from the optimizer's constructor (Adagrad's `step` 0 and `sum`) is dropped:
    # the run that never stopped has it (sweep seed 20262921, 1 of 16: "'optim.<frozen>.step':
    # the sharded run has no such record" right after the load). A frozen parameter never
    # stepped, so the fresh optimizer's own state for it is the saved one: `_load` keeps it.

    # ---- the steps a mutant may change ----------------------------------------------------------
    def rename(self, model_sd: dict) -> dict:
        return model_sd

    def planner(self):
        """DCP's default (every key must be in the checkpoint) without `flatten_sharded_tensors`
        (for nested 2-D ShardedTensors; FSDP1's are 1-D). With it, an FSDP1 rank that holds no
        shard of a parameter (3 ranks, a 12-element embedding) drops that key from its flattened
        state; the checkpoint has it, so DCP (torch 2.13 `DefaultLoadPlanner.create_local_plan`)
        takes the checkpoint for a pre-2.4 one and re-flattens the rank's state the old way, where
        a dict of no tensors is one key: with SGD without momentum the whole optimizer state dict
        (param groups only) became the key `optim`, "Missing key in checkpoint state_dict: optim."
        (tests/regressions/bc1e889bcc2f.json; likely also the nested `param_groups` of
        3c4190828ef8). Kept, the key holds an empty ShardedTensor and reads nothing."""
        return DefaultLoadPlanner(flatten_sharded_tensors=False)

    def set(self, optimizer, model_sd: dict, optim_sd: dict, strict: bool = True) -> None:
        options = StateDictOptions(strict=strict, flatten_optimizer_state_dict=True)
        set_state_dict(self.module, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)

    def after_load(self, optimizer, trainer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return trainer


STEPPED = "stepped."
# trace.meta key: the resumed run's param groups' hyperparameters as its optimizer was built,
# before the load (`param_groups_state`, as lists).
FRESH_PARAM_GROUPS = "fresh_param_groups"


def stepped_marks(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """`stepped.<fqn>`: 1 where the optimizer holds state for the parameter on any rank (it was
    stepped), else 0; a collective (the same tensors on every rank, as DCP keeps one copy). Every
    parameter of any rank's: a pipeline's ranks hold different ones (a stage each)."""
    mine = {n: int(bool(optimizer.state.get(p))) for n, p in module_names.named_parameters(module)}
    every = [mine]
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    marks: dict[str, int] = {}
    for part in every:
        for n, mark in part.items():
            marks[n] = max(marks.get(n, 0), mark)
    return {STEPPED + n: torch.tensor([mark], dtype=torch.int64) for n, mark in marks.items()}


def forget_unstepped_state(module: nn.Module, optimizer: torch.optim.Optimizer, trainer: dict) -> None:
    """Drop the optimizer state of every parameter the saving run had not stepped. `get_state_dict`
    on an optimizer without state initialises it with a zero-gradient step (torch's
    `_init_optim_state`: Adam's `step` 1, its moments zero), on the saving side (the checkpoint
    then holds that made-up state) and on the loading side alike; a parameter never stepped
    before the save (every step skipped by the loss scaler) resumes with it, and its first real
    step is Adam's step 2: the bias correction off by one (sweep seed 20262901: fp16 cases whose
    first steps all overflowed, 10 of 147). The run that never stopped holds no state there, so
    neither may the resumed one."""
    for name, p in module_names.named_parameters(module):
        mark = trainer.get(STEPPED + name)
        if mark is not None and int(mark[0]) == 0:
            optimizer.state.pop(p, None)


def unstepped_state_key(key: str, trainer: dict[str, torch.Tensor]) -> bool:
    """Whether `key` (`state.<fqn>.<entry>`, flattened) is the optimizer state of a parameter
    the saving run had not stepped. The checkpoint holds none for it where the optimizer had
    stepped others (torch's `_init_optim_state` makes state only for an optimizer with none): a
    parameter unfrozen after the last step that stepped (`unfreeze_step`; or every step since
    its unfreezing skipped by the loss scaler), which the loading side's template (a fresh
    optimizer, every trainable parameter initialised) has. Not read; `forget_unstepped_state`
    drops the template's made-up values after the load."""
    if not key.startswith("state."):
        return False
    mark = trainer.get(STEPPED + key.removeprefix("state.").rsplit(".", 1)[0])
    return mark is not None and int(mark[0]) == 0


def saved_step(path: str) -> int:
    """The step the checkpoint at `path` was saved after (a collective): what a resumed loop
    needs before its load (whether an unfreeze step came before the save)."""
    step = {"step": torch.empty(1, dtype=torch.int64)}
    with _quiet():
        dcp.load({"trainer": step}, checkpoint_id=path)
    return int(step["step"][0])


def trainer_template(path: str) -> dict[str, torch.Tensor]:
    """Empty tensors of the saved trainer state's shapes and dtypes, read from the checkpoint's
    metadata (the saving run's world size fixes the generators' shape)."""
    return saved_template(path).get("trainer", {})


def saved_template(path: str) -> dict[str, dict]:
    """Everything the checkpoint at `path` holds, as a state dict to load it into, by part
    (`model`, `optim`, `trainer`): an empty tensor of each saved tensor's shape and dtype, read
    from the checkpoint's metadata, and None for each other value (a param group's `lr`: DCP
    puts the saved one in its place)."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    out: dict[str, dict] = {}
    for key, meta in metadata.state_dict_metadata.items():
        part, _, name = key.partition(".")
        tensor = isinstance(meta, TensorStorageMetadata)
        out.setdefault(part, {})[name] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype) if tensor else None
    return out


def trainer_state(
    step: int, data_position: int, scaler, device: torch.device, scheduler=None, tp: int = 1, pp: int = 1
) -> dict[str, torch.Tensor]:
    """What this run saves beside model and optimizer (a collective: the ranks' generators are
    all-gathered, every rank saves the same tensors). A schedule saves its position
    (`last_epoch`, `_step_count`): the rate itself is in the optimizer's param groups, but a
    fresh scheduler would compute the next one from step 0 (LinearLR's warmup restarts). Under
    tensor parallelism the tp degree too (`tp`, absent at 1), under pipeline parallelism the pp
    degree (`pp`, absent at 1): the generators are one a data-parallel rank, and a run resumed on
    other degrees finds rank d's at d * tp (the first stage's ranks come first)."""
    mine = torch.get_rng_state()
    states = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(states, mine)  # gloo and the CPU generator: CPU tensors
    out = {
        "step": torch.tensor([step], dtype=torch.int64),
        "data_position": torch.tensor([data_position], dtype=torch.int64),
        "rng": torch.stack(states),
    }
    if tp > 1:
        out["tp"] = torch.tensor([tp], dtype=torch.int64)
    if pp > 1:
        out["pp"] = torch.tensor([pp], dtype=torch.int64)
    if scaler is not None:
        out["loss_scale.scale"] = torch.tensor([float(scaler.get_scale())], dtype=torch.float32)
        out["loss_scale.growth_tracker"] = torch.tensor([scaler._get_growth_tracker()], dtype=torch.int64)
    if scheduler is not None:
        out.update(schedule_state(scheduler))
    return out


def restore_trainer(trainer: dict[str, torch.Tensor], scaler, dp_rank: int, scheduler=None) -> None:
    """This rank's generator (its data-parallel rank's, if the saving run had that one; else its
    fresh seed stays), the loss scaler's state and the schedule's position (after the optimizer's
    load: its last rate is the loaded param groups' `lr`). Every rank of a data-parallel rank
    draws from one stream (verify/sharded/loop.py): data-parallel rank `dp_rank` takes the stream
    the saving run's data-parallel rank of that number had, at its rank dp_rank * (saved tp) (the
    first stage's, whatever the pp degree), so a change of the tp or pp degree keeps every
    replicated activation's mask one across its tp group and no two data-parallel ranks share a
    stream."""
    saved_tp = int(trainer["tp"][0]) if "tp" in trainer else 1
    saved_pp = int(trainer["pp"][0]) if "pp" in trainer else 1
    if "rng" in trainer and dp_rank < trainer["rng"].shape[0] // (saved_tp * saved_pp):
        torch.set_rng_state(trainer["rng"][dp_rank * saved_tp].clone())
    if scaler is not None and "loss_scale.scale" in trainer:
        scaler.load_state_dict(
            {
                **scaler.state_dict(),
                "scale": float(trainer["loss_scale.scale"][0]),
                "_growth_tracker": int(trainer["loss_scale.growth_tracker"][0]),
            }
        )
    if scheduler is not None and "schedule.last_epoch" in trainer:
        scheduler.load_state_dict(
            {
                **scheduler.state_dict(),
                "last_epoch": int(trainer["schedule.last_epoch"][0]),
                "_step_count": int(trainer["schedule.step_count"][0]),
                "_last_lr": [float(g["lr"]) for g in scheduler.optimizer.param_groups],
            }
        )


def rank_fingerprints(device: torch.device) -> torch.Tensor:
    """Every rank's generator fingerprint (a collective), in rank order."""
    mine = torch.tensor([rng_fingerprint(torch.get_rng_state())], dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    return torch.cat(parts).cpu()


def full_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The full (unsharded) model and optimizer state dicts on CPU, on rank 0 (empty elsewhere):
    what a single-device load or an export reads. A collective."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(module, optimizer, options=options)
