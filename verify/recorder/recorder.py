"""Recorder: one line around a user's own training step, on the single-GPU side and on every rank
of its sharded twin, so `fsdp-verify compare` can say where the two first part.

What a "step" is. Each `rec.step(...)` call is a step (numbered from 1; step 0 is the state when
the Recorder was built): it records the loss, the logits and the batch it is given. Optimizer
steps are counted separately, through hooks on the optimizer (so the user's step needs no other
line): gradients in the pre-step hook (after FSDP2's reduce-scatter, before the update), parameters
and optimizer state in the post-step hook. An optimizer step's records go into the file of the
next `rec.step` call, so with gradient accumulation (an optimizer step every k calls) k-1 calls
hold no optimizer records; `compare` pairs loss/logits/data by call and gradients/parameters by
optimizer step.

Under torchrun each rank records its own shard (a DTensor's local rows, with where they sit in the
full tensor) into OUT/rank{r}/; nothing is gathered and no collective is issued, so recording
cannot hang or reorder the run's communication.
"""

from __future__ import annotations

import fnmatch
import platform
import warnings
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

from fsdp_verify.compare.tolerance import unit_roundoff
from fsdp_verify.recorder.fingerprints import as_rows, local_view, row_stats, rows_only, sample_hashes, total_stats
from fsdp_verify.recorder.names import strip_wrappers
from fsdp_verify.recorder.perturb import GradientPerturbation, seed_from_env
from fsdp_verify.recorder.store import RUN_KIND, SCHEMA_VERSION, write_meta, write_state, write_step
from fsdp_verify.training.optim import param_groups_state, schedule_state


def _dist() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _rows_placements(p: torch.Tensor):
    """A parameter's placements where its local part is a block of rows (`rows_only`); None
    where it is recorded otherwise (plain, or gathered whole: `local_view`)."""
    placements = getattr(p, "placements", None)
    return placements if placements is not None and rows_only(placements) else None


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def precision_of(model: nn.Module) -> dict:
    """Where the run rounds: whether the model is under FSDP2's `fully_shard` and the distinct
    MixedPrecisionPolicy its units run (dtypes as strings, None: the parameter's own). `compare`
    judges a bf16 pair only when both runs rounded at the same places, i.e. ran the same policies
    (a one-rank `fully_shard` reference against its sharded twin), see rules.py."""
    policies = []
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        mp = get_state()._mp_policy
        policy = {
            "param_dtype": _name(mp.param_dtype),
            "reduce_dtype": _name(mp.reduce_dtype),
            "output_dtype": _name(mp.output_dtype),
            "cast_forward_inputs": bool(mp.cast_forward_inputs),
        }
        if policy not in policies:
            policies.append(policy)
    return {"fully_shard": bool(policies), "policies": policies}


def _name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


def _check_optimizer_holds(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer over parameters the model no longer has, by identity: one built before
    `fully_shard` (which swaps every parameter for a sharded one) steps the old, unsharded tensors,
    and the run would otherwise show only as parameters that "did not move" at step 1."""
    mine = {id(p) for p in model.parameters()}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = [p for p in held if id(p) not in mine]
    if foreign:
        first = foreign[0]
        raise ValueError(
            f"optimizer: expected an optimizer over the model's parameters; {len(foreign)} of its {len(held)}"
            f" parameters are not the model's (the first: shape {tuple(first.shape)}, {type(first).__name__})."
            " An optimizer built before fully_shard (or before wrapping or moving the model) holds the old"
            " parameters and steps them, not the model's: build it after, over model.parameters()"
        )


def _warn_if_not_sharded(params: list[tuple[str, nn.Parameter]], intent: dict, rank: int) -> None:
    """Said at once, on rank 0, when a run meant to shard holds no DTensor: FSDP was not applied
    here (a silent fallback). `compare` gives the verdict, NOT SHARDED, from every rank's record."""
    if rank == 0 and intent["expected"] and params and all(getattr(p, "placements", None) is None for _, p in params):
        warnings.warn(
            f"fsdp-verify Recorder: this run is meant to shard its parameters ({intent['by']}), but every one of"
            f" its {len(params)} parameters is a plain tensor here: FSDP was not applied; `fsdp-verify compare`"
            " will say NOT SHARDED",
            stacklevel=3,
        )


def sharding_intent(world_size: int, sharded: bool | None, sharded_by: str | None) -> dict:
    """settings.sharded in meta.json: whether the run is meant to shard its parameters, and what
    said so (the user, an integration naming its library's setting, or the world size)."""
    if sharded is None:
        return {"expected": world_size > 1, "by": sharded_by or f"it runs on {world_size} ranks"}
    return {"expected": bool(sharded), "by": sharded_by or "Recorder(sharded=...)"}


def resumed_from_meta(path: str | Path) -> dict:
    """Where the run at `path` stopped (its rank 0's meta: steps and optimizer steps), and its
    absolute path, which the resumed run's meta names."""
    import json

    from fsdp_verify.recorder.store import RunError, rank_dir

    meta_path = rank_dir(path, 0) / "meta.json"
    if not meta_path.is_file():
        raise RunError(f"resumed_from: {path}: no rank0/meta.json (the run before the resume, closed)")
    meta = json.loads(meta_path.read_text())
    return {"path": str(Path(path).resolve()), "steps": meta["steps"], "optimizer_steps": meta["optimizer_steps"]}


class Recorder:
    """Record a run for `fsdp-verify compare`.

    model, optimizer: as built by the user's script (after `fully_shard`, with the optimizer over
      the sharded parameters). Hooks are registered on the optimizer; `close()` removes them.
    out: the run's directory (each rank writes out/rank{r}/).
    full_steps: steps (rec.step numbers; 0 = initial state) whose parameters, gradients and
      optimizer state are stored whole (each rank its shard), besides the fingerprints.
    full_params: fnmatch patterns of (stripped) parameter names stored whole at every step.
    perturb: a seed for perturbation mode (a calibration run of the reference script; default
      the FSDP_VERIFY_PERTURB environment variable), see perturb.py.
    modules: fnmatch patterns of (stripped) module names ("layers.*") whose forward outputs are
      fingerprinted per row at every step, so `compare` names the first module whose output parts
      (docs/zoom.md); each call's rows in order, a recomputation in backward not counted.
    resumed_from: the run directory the run this one resumes recorded (closed), for a loop that
      loaded a checkpoint: its steps and optimizer steps are counted on from where that run
      stopped, and `compare` reads the two as one run (docs/resume.md). Built after the load:
      the state it finds (parameters, optimizer state, param groups) is compared exactly with
      the state the run before closed with (its checkpoint's, saved at its end).
    scheduler: the lr scheduler, if the loop has one: its position is part of that state.
    sharded: whether this run is meant to shard its parameters (FSDP). None: yes when it runs on
      more than one rank (the sharded twin); False for a data-parallel run that replicates them on
      purpose (DDP). `compare` says NOT SHARDED when a run meant to shard holds parameters that are
      plain tensors on every rank (sharding.py); replicas that drift apart are named either way.
    sharded_by: what said the run is meant to shard (the integrations name the library setting,
      "TrainingArguments.fsdp"), quoted in that verdict.
    closure_step: the loop steps the optimizer with a closure that runs forward and backward
      inside `optimizer.step` (Lightning's automatic optimization, LBFGS): the gradients are not
      there when the optimizer's pre-step hook runs, so the caller calls
      `before_optimizer_step()` once they are.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        out: str | Path,
        *,
        full_steps: Iterable[int] = (),
        full_params: Iterable[str] = (),
        perturb: int | None = None,
        modules: Iterable[str] = (),
        resumed_from: str | Path | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        sharded: bool | None = None,
        sharded_by: str | None = None,
        closure_step: bool = False,
    ):
        self.out = Path(out)
        self.resumed_from = resumed_from_meta(resumed_from) if resumed_from is not None else None
        self.rank, self.world_size = _dist()
        self.sharding = sharding_intent(self.world_size, sharded, sharded_by)
        self.full_steps, self.full_params = set(full_steps), list(full_params)
        self.optimizer, self.scheduler = optimizer, scheduler
        self.params: list[tuple[str, nn.Parameter]] = []
        seen: dict[str, str] = {}
        for fqn, p in model.named_parameters():
            name = strip_wrappers(fqn)
            if name in seen:
                raise ValueError(f"model: parameters {seen[name]!r} and {fqn!r} both strip to {name!r}")
            seen[name] = fqn
            self.params.append((name, p))
        _check_optimizer_holds(model, optimizer)
        _warn_if_not_sharded(self.params, self.sharding, self.rank)
        # Where each rank's rows sit never changes, and gradients and optimizer state are placed as
        # their parameter: computed once here (DTensor's placement arithmetic is Python; caching it
        # took the recorder from 1.119 to 1.060 of the bare run at world size 2 on the bench).
        self.placement = {n: (_rows_placements(p), p.shape, *local_view(p)[1:]) for n, p in self.params}
        self.precision = precision_of(model)
        seed = perturb if perturb is not None else seed_from_env()
        # Under a policy the gradients were rounded to its param_dtype (the unsharded gradient,
        # before the reduce): the perturbation moves them by that dtype's roundoff, not fp32's.
        coarse = [p["param_dtype"] for p in self.precision["policies"] if p["param_dtype"]]
        rounded = max((getattr(torch, d) for d in coarse), key=unit_roundoff, default=None)
        self.perturbation = GradientPerturbation(seed, rounded) if seed is not None else None
        # Under a coarse policy: the magnitudes each backward rounded to param_dtype (rules.py's
        # bound under a policy; a gradient whose terms cancel is rounded at its partial sums').
        self._rounded: dict[str, torch.Tensor] = {}
        self._watched: set[int] = set()
        self.call = 0  # rec.step calls so far (the run resumed from's among them)
        self.opt_step = 0  # optimizer steps so far (likewise)
        if self.resumed_from is not None:
            self.call, self.opt_step = self.resumed_from["steps"], self.resumed_from["optimizer_steps"]
        self.dtypes: dict[str, set[str]] = {}
        self._pending: dict[str, torch.Tensor] = {}
        self._meta_dtypes: dict | None = None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp-verify-recorder")
        self._written = None
        self._header: dict = {"opt_steps": []}
        self._hooks = [optimizer.register_step_post_hook(self._after_optimizer)]
        if not closure_step:
            self._hooks.append(optimizer.register_step_pre_hook(lambda *_: self.before_optimizer_step()))
        self.module_patterns = list(modules)
        self._outputs: dict[str, list[tuple[torch.Tensor, torch.Tensor, list[int]]]] = {}
        self._ran: list[str] = []  # this step's modules in the order they first ran
        for fqn, module in model.named_modules():
            name = strip_wrappers(fqn)
            wanted = any(fnmatch.fnmatchcase(name, pat) for pat in self.module_patterns)
            if wanted and name not in self._outputs:  # a wrapper and the module it wraps strip alike: once
                self._outputs[name] = []
                self._hooks.append(module.register_forward_hook(self._module_output(name)))
        if self.module_patterns and not self._outputs:
            raise ValueError(f"modules: no module name matches {self.module_patterns} (names as in named_modules())")
        if rounded is not None:
            self._watch_rounding(model)
        if self.resumed_from is not None:  # the state it loaded: `compare` holds it to the one saved
            self._write_meta()
            self._state("at_load")
            return
        self._group("opt0/params", self.params, full=0 in self.full_steps, exact=True)
        self._header["opt_steps"].append(0)
        self._flush()

    # ---- what is recorded ------------------------------------------------------------------------
    def _wants_full(self, name: str, full_step: bool) -> bool:
        return full_step or any(fnmatch.fnmatchcase(name, pat) for pat in self.full_params)

    def _group(
        self, prefix: str, named: list[tuple[str, torch.Tensor]], full: bool, exact: bool = False, totals: bool = False
    ) -> None:
        self._groups([(prefix, named)], full, exact, totals)

    def _groups(self, groups: list[tuple[str, list]], full: bool, exact: bool = False, totals: bool = False) -> None:
        """Fingerprints of the local shards of each group's tensors: per row (accumulated in
        float64 if `exact`), or per tensor if `totals` (see fingerprints.py), all groups in one
        pass of fused kernels and one transfer; the shards whole where asked.
        Layout entry: [name, rows here, first row, rows in all, full shape, kind], kind "rows",
        "total" (a shard's total: compare adds the ranks') or "total-replica" (a whole tensor on
        every rank: compare takes one)."""
        locals_, counts = [], []
        for prefix, named in groups:
            layout = []
            for name, t in named:
                placements, param_shape, offset, rows = self.placement[name]
                if placements is not None and getattr(t, "placements", None) == placements and t.shape == param_shape:
                    local = t.to_local()  # placed as its parameter: rows and offset known
                else:
                    local, offset, rows = local_view(t)
                locals_.append(local)
                kind = "rows" if not totals else ("total-replica" if local.shape == t.shape else "total")
                shape = list(t.shape)
                layout.append([name, int(local.shape[0]) if local.ndim else 1, int(offset), int(rows), shape, kind])
                if full or (self.full_params and self._wants_full(name, False)):
                    self._pending[f"full/{prefix}/{name}"] = local.detach().cpu().clone()
            self.dtypes.setdefault(prefix.split("/", 1)[1], set()).update({_dtype(t) for t in locals_[-len(named) :]})
            self._header[prefix] = layout
            counts.append(sum(entry[1] for entry in layout) if not totals else len(layout))
        # Totals: sums for the first group only (the parameters), norms for all (see total_stats).
        sums, squares = total_stats(locals_, counts[0]) if totals else row_stats(locals_, exact)
        for (prefix, _), a, b in zip(groups, sums.split(counts), squares.split(counts)):
            self._pending[f"{prefix}/row_sum"], self._pending[f"{prefix}/row_sq"] = a.clone(), b.clone()

    def _module_output(self, name: str):
        def hook(_module, _args, out) -> None:
            if torch._C._current_graph_task_id() != -1:  # activation checkpointing's recomputation
                return
            t = (
                out
                if isinstance(out, torch.Tensor)
                else next(
                    (x for x in (out if isinstance(out, (tuple, list)) else ()) if isinstance(x, torch.Tensor)), None
                )
            )
            if t is None or not t.is_floating_point():
                return
            t = t.to_local() if hasattr(t, "to_local") else t
            # Before any update: held to the bound like the logits, so fingerprinted in float64.
            before_update = self.opt_step == 0
            with torch.no_grad():
                sums, squares = row_stats([t], exact=before_update)
            if not self._outputs[name]:
                self._ran.append(name)
            self._outputs[name].append((sums, squares, list(t.shape)))
            self.dtypes.setdefault("modules", set()).add(_dtype(t))

        return hook

    def _watch_rounding(self, model: nn.Module) -> None:
        """Before the first optimizer step, the row norms of every unsharded gradient a backward
        rounds to param_dtype, summed over the backward passes: the magnitude the rounding is
        relative to (each rank's partial gradient here, the whole batch's on a one-rank
        reference). Read in a post-accumulate-grad hook on the unsharded parameter, which FSDP2
        puts in the module's place before its forward (public hooks only; a rounded gradient's
        magnitude stands for the unrounded one's within a factor 1 + u)."""
        names = {id(p): name for name, p in self.params}
        for module in model.modules():
            owned = [(attr, names[id(p)]) for attr, p in module._parameters.items() if p is not None and id(p) in names]
            if owned:
                self._hooks.append(module.register_forward_pre_hook(self._watch_unsharded(owned)))

    def _watch_unsharded(self, owned: list[tuple[str, str]]):
        def hook(module, _args) -> None:
            if self.opt_step > 0:
                return
            for attr, name in owned:
                t = module._parameters.get(attr)
                if t is None or not t.requires_grad or hasattr(t, "placements") or id(t) in self._watched:
                    continue  # frozen, still sharded (no unshard ran), or watched already
                self._watched.add(id(t))
                self._hooks.append(t.register_post_accumulate_grad_hook(self._rounding_of(name)))

        return hook

    def _rounding_of(self, name: str):
        @torch.no_grad()
        def hook(unsharded: torch.Tensor) -> None:
            if self.opt_step > 0 or unsharded.grad is None:
                return
            norms = torch.linalg.vector_norm(as_rows(unsharded.grad), 2, dim=1, dtype=torch.float64).cpu()
            self._rounded[name] = self._rounded[name] + norms if name in self._rounded else norms

        return hook

    @torch.no_grad()
    def _state(self, when: str) -> None:
        """The whole state now, to compare exactly across a resume (the state right after a
        load against the one the run before ended with, which it saved): every parameter and
        optimizer state tensor (Adam's scalar `step` too) fingerprinted per row in float64, and
        in the header the param groups' hyperparameters and the schedule's position. One pass
        over the shards, at the load and at close()."""
        kept = self._pending, self._header, {k: set(v) for k, v in self.dtypes.items()}
        self._pending, self._header = {}, {}
        by_key: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for name, p in self.params:
            for key, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    by_key.setdefault(key, []).append((name, value))
        groups = [(f"{when}/params", self.params)] + [(f"{when}/optim.{k}", v) for k, v in sorted(by_key.items())]
        self._groups(groups, full=False, exact=True)
        hyper = {**param_groups_state(self.optimizer)}
        if self.scheduler is not None:
            hyper.update(schedule_state(self.scheduler))
        self._header["hyperparameters"] = {k: v.tolist() for k, v in hyper.items()}
        write_state(self.out, self.rank, when, self._pending, self._header)
        self._pending, self._header, self.dtypes = kept

    @torch.no_grad()
    def before_optimizer_step(self) -> None:
        """Record the gradients of the optimizer step about to run (the optimizer's pre-step hook
        calls it, or the caller with `closure_step=True`)."""
        if self.opt_step == 0 and self._rounded:  # stored with the first optimizer step's gradients
            names = sorted(self._rounded)
            self._pending["rounding/row_norm"] = torch.cat([self._rounded[n] for n in names])
            self._header["rounding"] = [[n, int(self._rounded[n].numel())] for n in names]
            self._rounded = {}
        self.opt_step += 1
        named = [(n, p.grad) for n, p in self.params if p.grad is not None]
        if self.perturbation is not None:
            for _, g in named:
                self.perturbation.move(local_view(g)[0])
        # The first optimizer step's gradients are held to the bound: fingerprints in float64.
        self._group(f"opt{self.opt_step}/grads", named, self.call + 1 in self.full_steps, exact=self.opt_step == 1)

    @torch.no_grad()
    def _after_optimizer(self, optimizer, args, kwargs) -> None:
        k, full = self.opt_step, self.call + 1 in self.full_steps
        by_key: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for name, p in self.params:
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == p.shape and value.is_floating_point():
                    by_key.setdefault(key, []).append((name, value))
        groups = [(f"opt{k}/params", self.params)] + [(f"opt{k}/optim.{key}", v) for key, v in sorted(by_key.items())]
        self._groups(groups, full, totals=True)
        self._header["opt_steps"].append(k)

    @torch.no_grad()
    def step(self, loss: torch.Tensor | float | None = None, logits: torch.Tensor | None = None, batch=None) -> None:
        """Record this step's loss (this rank's), logits (this rank's, samples along dim 0) and
        batch (a tensor or a dict/tuple of tensors, samples along dim 0), and write the step's file
        with the optimizer steps since the previous call."""
        self.call += 1
        if loss is not None:
            value = loss.detach().float().cpu() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
            self._pending["loss"] = value.double().reshape(())
            if isinstance(loss, torch.Tensor):
                self.dtypes.setdefault("loss", set()).add(_dtype(loss))
        if logits is not None:
            # Logits computed before any update are held to the bound: fingerprints in float64.
            before_update = self.opt_step == len([k for k in self._header["opt_steps"] if k > 0])
            rows, squares = row_stats([logits], exact=before_update)
            self._pending["logits/row_sum"], self._pending["logits/row_sq"] = rows, squares
            self._header["logits"] = list(logits.shape)
            self.dtypes.setdefault("logits", set()).add(_dtype(logits))
        if batch is not None:
            self._pending["data/hashes"] = sample_hashes(batch)
        if self._outputs:  # in the order the modules first ran: the order compare searches in
            order = []
            for name in self._ran:
                calls = self._outputs[name]
                self._pending[f"module/{name}/row_sum"] = torch.cat([c[0] for c in calls])
                self._pending[f"module/{name}/row_sq"] = torch.cat([c[1] for c in calls])
                order.append([name, calls[0][2]])
                calls.clear()
            self._ran = []
            self._header["modules"] = order
        self._flush()

    def _flush(self) -> None:
        self._header["call"] = self.call
        # Written by one background thread, so the loop does not wait on the disk (a step's file
        # is ~140 kB of fingerprints); an error surfaces at the next step or at close().
        if self._written is not None:
            self._written.result()
        self._written = self._writer.submit(write_step, self.out, self.rank, self.call, self._pending, self._header)
        self._pending, self._header = {}, {"opt_steps": []}
        dtypes = {k: sorted(v) for k, v in self.dtypes.items()}
        if dtypes != self._meta_dtypes:  # meta.json when something in it changed, and at close()
            self._meta_dtypes = dtypes
            self._write_meta()

    def _write_meta(self) -> None:
        from fsdp_verify import __version__

        write_meta(
            self.out,
            self.rank,
            {
                "kind": RUN_KIND,
                "schema_version": SCHEMA_VERSION,
                "rank": self.rank,
                "world_size": self.world_size,
                "steps": self.call,
                "optimizer_steps": self.opt_step,
                "params": [[n, list(p.shape), _dtype(p)] for n, p in self.params],
                "dtypes_seen": {k: sorted(v) for k, v in sorted(self.dtypes.items())},
                "optimizer": type(self.optimizer).__name__,
                "settings": {
                    "full_steps": sorted(self.full_steps),
                    "full_params": self.full_params,
                    "perturb": self.perturbation.seed if self.perturbation else None,
                    "modules": self.module_patterns,
                    "precision": self.precision,
                    "sharded": self.sharding,
                },
                # Parameters that are plain tensors here (not a DTensor): on every rank of a run
                # meant to shard, FSDP was not applied to them (compare's NOT SHARDED verdict).
                "plain_params": [n for n, p in self.params if getattr(p, "placements", None) is None],
                **(
                    {"resumed_from": self.resumed_from["path"], "resumed_after": self.resumed_from["steps"]}
                    if self.resumed_from is not None
                    else {}
                ),
                "torch": torch.__version__,
                "fsdp_verify": __version__,
                "python": platform.python_version(),
                "updated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            },
        )

    def close(self) -> None:
        """Wait for the last step's file, write the state the run ends with (what a checkpoint
        saved at its end holds, for the run that resumes from it) and meta.json, remove the
        optimizer hooks."""
        if self._written is not None:
            self._written.result()
            self._written = None
        self._writer.shutdown(wait=True)
        if self._hooks:  # once: a second close() finds the state written
            self._state("at_close")
        self._write_meta()
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
