"""Single-process reference trainer. Kept short and plain so it can be checked by eye: it shares
the model, data and optimizer choice with the sharded side, and nothing of its sharding path.

`emulate=True` (the default) reproduces the sharded arithmetic without any process group: every
data-parallel rank's micro-batch is run separately, with parameters and inputs cast as FSDP2's
MixedPrecisionPolicy casts them, gradients in `param_dtype`, upcast to `reduce_dtype`, summed over
ranks in rank order and divided by the world size (ReduceOp.AVG), then accumulated into fp32
master gradients. `emulate=False` runs each micro-batch of the global batch in one piece (one
virtual rank): numerically equivalent, differently rounded; it calibrates the noise floor.

A step is a sequence of named phases (`_Run`'s methods, called in order by `train_reference`),
each a screen long, so that a new knob changes one phase and the reference stays checkable by eye.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.func import functional_call

from fsdp_verify.case import Case
from fsdp_verify.dims import registry
from fsdp_verify.dtypes import to_torch
from fsdp_verify.engines import engine_arithmetic
from fsdp_verify.engines.arithmetic import FSDP2, Arithmetic, gloo_allreduce_sum, gloo_scalar_sum
from fsdp_verify.models import is_frozen, is_ignored
from fsdp_verify.models.custom import logits_of
from fsdp_verify.reference.expert_parallel import ep_average, ep_norm, ep_sums, global_routing, update_router_biases
from fsdp_verify.reference.fusion import FusionJolt
from fsdp_verify.reference.grouped_gemm import HolderGrads
from fsdp_verify.reference.loss_scale import DynamicLossScale
from fsdp_verify.reference.perturbation import Perturbation
from fsdp_verify.reference.pipeline_parallel import after_reduction as pp_after_reduction
from fsdp_verify.reference.pipeline_parallel import average as pp_average
from fsdp_verify.reference.pipeline_parallel import backward_loss, untie, untied
from fsdp_verify.reference.pipeline_parallel import stages_norm as pp_stages_norm
from fsdp_verify.reference.records import (
    RankPass,
    RankShare,
    carried_over,
    record_buffers,
    record_params,
    record_resumed,
    store_logits,
)
from fsdp_verify.reference.reduction import (
    FlatLayout,
    average,
    divide_factors,
    hsdp_average,
    norm_from_shards,
    placement_dim,
)
from fsdp_verify.reference.reference_model import reference_model
from fsdp_verify.reference.tensor_parallel import TensorParallel, tp_locals
from fsdp_verify.torch_support import private_name
from fsdp_verify.trace import Trace
from fsdp_verify.training.data import as_call, global_batch, item_count, microbatch_slices, take
from fsdp_verify.training.loss import global_mean_scale, microbatch_loss
from fsdp_verify.training.optim import (
    make_optimizer,
    make_scheduler,
    optimizer_state,
    run_model_hook_before_step,
    schedule_state,
    step_scheduler,
)
from fsdp_verify.training.rng import dropout_states, rank_streams, rng_fingerprint
from fsdp_verify.zoom.watch import ModuleWatch


def train_reference(
    case: Case,
    emulate: bool = True,
    order: str = "ring",
    unit_input_node: bool | None = None,
    perturb: int | None = None,
    arithmetic: Arithmetic = FSDP2,
    share: RankShare | None = None,
    fusion: int | None = None,
) -> Trace:
    """`order` is the order in which the ranks' gradients are summed: "ring" as gloo's
    reduce-scatter adds them (see `average`), with a clip's global norm from the ranks' shard
    norms as FSDP2 computes it (`norm_from_shards`); "rank" (0, 1, ...), "reverse" (with the
    norm of the full gradients, summed in reverse) or "flat" (gloo's order over each unit's
    gradients flattened into one padded buffer, see `FlatLayout.average`): the latter three are
    calibration runs. `unit_input_node=False` leaves out FSDP2's identity node on unit inputs
    (`_PostBackwardNode`), as FSDP1 and most home-grown engines do: another calibration run.
    `perturb=SEED` moves every result a correct engine may compute in another order by its
    derived error bound, with random signs (`Perturbation`): the run that sets the floor.
    `arithmetic` is what the engine under test declares (verify/engines/arithmetic.py): with a
    "flat" layout the "ring" emulation follows its flat buffers (`FlatLayout`) for the
    reduction and the clip's norm, and its `unit_input_node` is the default. `share` splits the
    emulated ranks' forward and backward passes over processes (verify/sharded/shared_reference.py:
    the ranks of a run in place under torchrun); every process then averages and steps alike.
    `fusion=SEED` (a compiled case): the run eager, every operation of the compiled modules moved
    by what a compiler may change in it (reference/fusion.py): the floor of compiled against eager."""
    run = _Run.build(case, emulate, order, unit_input_node, perturb, arithmetic, share, fusion)
    for step in range(1, case.steps + 1):
        run.unfreeze(step)
        state = run.begin_step(step)
        for m, group in enumerate(state.groups):
            with global_routing(run, state, group):  # an aux loss's counts: the micro-batch's
                passes = run.rank_passes(state, group, m)  # each emulated rank's forward and backward
            rank_grads = run.collect(state, m, group, passes)
            run.reduce(state, m, rank_grads)
        run.hand_grads_to_params(state)
        run.record_passes(state)
        skip = run.unscale(state)
        run.clip(state)
        run.optimizer_step(skip)
        run.record_state(step)
        if step == case.resume_after:  # the run goes on where the resumed one does (docs/resume.md)
            after = case.after_resume()
            run = run.resumed(
                after, engine_arithmetic(after.engine) if case.resume_engine else arithmetic, unit_input_node
            )
            run.record_resumed(step)
    return run.finish()


@dataclass
class _Step:
    """One step's batch and what its phases accumulate."""

    step: int
    inputs: object
    targets: torch.Tensor
    groups: list[list]  # groups[m] = the per-rank sample slices of micro-batch m (one virtual rank if not emulating)
    loss_factor: float  # each (virtual) rank's loss sum times this: the mean over the step's real tokens
    # Every rank computes with the same cast of the parameters: one set of leaves for all
    # (`autograd.grad` gives each rank's graph its own gradients; nothing accumulates).
    compute: dict[str, torch.Tensor]
    trainable: list[str]
    logits: dict[int, torch.Tensor]  # by sample
    rank_loss: list[torch.Tensor]  # each rank's sum over micro-batches
    master_grads: dict[str, torch.Tensor]  # fp32, reduced
    local_grads: list[dict[str, torch.Tensor]]  # sync-last accumulators, per rank
    fingerprints: dict[str, list[int]]  # verify/probes/rng.py
    # `replica_sync_last`: per unit, each replica's reduce-scattered gradients of the micro-batches
    # not yet all-reduced (FSDP2's `_partial_reduce_output`), in reduce_dtype; by tp rank.
    partial: dict[int, dict[str, list[torch.Tensor]]] = field(default_factory=dict)
    # `ignored`: each rank's gradients of the parameters FSDP2 leaves alone, accumulated in fp32
    # over the micro-batches until the loop all-reduces them.
    ignored_grads: list[dict[str, torch.Tensor]] = field(default_factory=list)


def emulates_ep(case: Case, emulate: bool, order: str, layout) -> bool:
    """Expert parallelism's reduction emulated (reference/expert_parallel.py): FSDP2's own
    arithmetic, every rank emulated; the calibration runs sum the ranks' expert gradients in
    their own orders, as any other gradient's."""
    return case.ep > 1 and order == "ring" and layout is None and emulate


@dataclass
class _Run:
    """A reference run's context, built once (`build`): what every phase reads. `rng_states`
    (each rank's dropout generator), the optimizer, the scaler, the perturbation's generator and
    the trace move on as the run goes; nothing else changes."""

    case: Case
    emulate: bool
    order: str
    model: nn.Module
    params: dict[str, nn.Parameter]  # tied weights appear once
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None  # the case's learning-rate schedule
    layout: FlatLayout | None  # a flat engine's buffers, for the reduction and the clip's norm
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    divide: tuple[float, float]  # the engine's own division of the average (`Arithmetic.divide_factors`)
    jolt: Perturbation | None
    scaler: DynamicLossScale | None
    share: RankShare | None
    rng_states: list[torch.Tensor]
    trace: Trace
    watch: ModuleWatch | None = None  # a zoom's probes (verify/zoom/watch.py), on `model`
    # Where the engine computes on views of each unit's flat buffer, that buffer's layout
    # (`Arithmetic.computes_on_flat_views`): the compute copies sit at the same offsets.
    views: FlatLayout | None = None
    fusion: FusionJolt | None = None  # the compiler's freedoms, on an eager run (reference/fusion.py)
    # Tensor parallelism's arithmetic, emulated on `model` (reference/tensor_parallel.py).
    tp: TensorParallel | None = None
    # Parameters a dimension package has the ranks compute with in another dtype than
    # `param_dtype` (float8's all-gathered weights: fp32, verify/dims/float8/runtime.py).
    compute_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    # A grouped GEMM's ep holders' gradients, emulated (reference/grouped_gemm.py).
    held_rows: HolderGrads | None = None

    @classmethod
    def build(
        cls,
        case: Case,
        emulate: bool,
        order: str,
        unit_input_node: bool | None,
        perturb: int | None,
        arithmetic: Arithmetic,
        share: RankShare | None,
        fusion: int | None = None,
    ) -> _Run:
        """The model with the engine's casts, its optimizer, the emulated layout, and the initial
        records (step 0)."""
        model = reference_model(case, arithmetic, unit_input_node, compiled=fusion is None)
        jolted = _fusion(case, model, FusionJolt(fusion) if fusion is not None else None)
        watch = _watch(case, model)
        if share is not None:
            share.begin(model)
        params = dict(model.named_parameters())  # tied weights appear once
        optimizer = make_optimizer(case.optim, params.values())
        run_model_hook_before_step(model, optimizer)
        scheduler = make_scheduler(case.optim, optimizer, case.steps)
        flat = order == "flat" or (order == "ring" and arithmetic.layout == "flat")
        emulated = arithmetic if order == "ring" else Arithmetic(layout="flat")
        layout = FlatLayout(model, case, emulated) if flat else None
        moves = perturb if perturb is not None else fusion
        trace = Trace("reference", meta={"case": case.hash, "emulate": emulate, "order": order, "perturbed": moves})
        if fusion is not None:
            trace.meta["moved"] = []  # every record inherits the moves (reference/fusion.py)
        jolt = Perturbation(perturb, case.dp_size) if perturb is not None else None
        record_params(trace, 0, params, initial=True)
        record_buffers(trace, 0, model)

        param_dtype = to_torch(case.precision.param_dtype) or torch.float32
        reduce_dtype = to_torch(case.precision.reduce_dtype) or param_dtype
        # The engine's own division of the average (every order: a division, not a summation order).
        divide = divide_factors(case, arithmetic, reduce_dtype, case.dp_size)
        # Each data-parallel rank draws dropout masks from its own generator; replay every stream.
        rng_states = dropout_states(case)
        scaler = DynamicLossScale(case.loss_scaling) if case.loss_scaling is not None else None
        return cls(
            case=case,
            emulate=emulate,
            order=order,
            model=model,
            params=params,
            optimizer=optimizer,
            scheduler=scheduler,
            layout=layout,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            divide=divide,
            jolt=jolt,
            scaler=scaler,
            share=share,
            rng_states=rng_states,
            trace=trace,
            watch=watch,
            views=FlatLayout(model, case, arithmetic) if arithmetic.computes_on_flat_views else None,
            fusion=jolted,
            tp=TensorParallel(case, model) if case.tp > 1 else None,
            compute_dtypes={k: v for d in registry.call(case, "compute_dtypes", model) for k, v in d.items()},
            held_rows=HolderGrads.install(case, model) if emulates_ep(case, emulate, order, layout) else None,
        )

    def unfreeze(self, step: int) -> None:
        """From the case's `unfreeze_step` on, the parameters `model.frozen` names train: they
        require grad, and the optimizer, which holds every parameter, steps them once they have
        a gradient (`begin_step` takes the trainable ones from `requires_grad`)."""
        if step != self.case.unfreeze_step:
            return
        for n, p in self.params.items():
            if is_frozen(self.case.model, n):
                p.requires_grad_(True)

    # ---- a resume -------------------------------------------------------------------------------
    def resumed(self, after: Case, arithmetic: Arithmetic, unit_input_node: bool | None) -> _Run:
        """The run as the resumed one goes on: `after`'s world size, mesh and engine arithmetic
        (its casts, layout and division), the parameters, buffers, optimizer state, loss scale
        and trace carried over in memory (copies, exact: what a correct save and load give). A
        rank the run had keeps its dropout generator; a new one starts from its fresh seed (as
        verify/training/resume.py restores them)."""
        model = reference_model(after, arithmetic, unit_input_node, compiled=self.fusion is None)
        carried_over(self.model, model)
        params = dict(model.named_parameters())
        if after.unfreeze_step is not None and after.unfreeze_step <= self.case.resume_after:
            # Unfrozen before the save: they train on (a later unfreeze step comes in `unfreeze`).
            for n, p in params.items():
                if is_frozen(after.model, n):
                    p.requires_grad_(True)
        optimizer = make_optimizer(after.optim, params.values())
        run_model_hook_before_step(model, optimizer)
        scheduler = make_scheduler(after.optim, optimizer, after.steps)  # before the load, as a loop builds it
        optimizer.load_state_dict(self.optimizer.state_dict())
        if scheduler is not None:
            scheduler.load_state_dict(self.scheduler.state_dict())
        # Data-parallel rank d resumes with the stream d saved (every rank of it, its tp ranks and
        # stages alike: `rank_streams`), whatever the tp and pp degrees on either side; a rank d
        # the saving run did not have keeps its fresh seed (verify/training/resume.py).
        fresh = dropout_states(after)
        rng_states = [self.rng_states[d] if d < len(self.rng_states) else fresh[d] for d in range(after.dp_size)]
        jolt = None
        if self.jolt is not None:  # the same moves, for the new number of ranks
            jolt = Perturbation(0, after.dp_size)
            jolt.generator, jolt.moved = self.jolt.generator, self.jolt.moved
        flat = self.order == "flat" or (self.order == "ring" and arithmetic.layout == "flat")
        emulated = arithmetic if self.order == "ring" else Arithmetic(layout="flat")
        layout = FlatLayout(model, after, emulated) if flat else None
        return _Run(
            case=after,
            emulate=self.emulate,
            order=self.order,
            model=model,
            params=params,
            optimizer=optimizer,
            scheduler=scheduler,
            layout=layout,
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            divide=divide_factors(after, arithmetic, self.reduce_dtype, after.dp_size),
            jolt=jolt,
            scaler=self.scaler,
            share=None,
            rng_states=rng_states,
            trace=self.trace,
            views=FlatLayout(model, after, arithmetic) if arithmetic.computes_on_flat_views else None,
            fusion=_fusion(after, model, self.fusion),
            # The resumed run's own tp degree and plan on the new model (the optimizer state and
            # parameters carried over are full tensors: a tp degree is how they are computed on,
            # not what they hold).
            tp=TensorParallel(after, model) if after.tp > 1 else None,
            # A zoom into a step after the save watches the resumed run's model (verify/zoom/locate.py
            # `zoom_case`); its steps before the save watched nothing.
            watch=_watch(after, model),
        )

    def record_resumed(self, step: int) -> None:
        """The state a correct load gives, under phase "resumed" at the step saved after (the
        sharded side records what it loaded: verify/sharded/loop.py `_resume`)."""
        add = self.trace.add
        record_resumed(self.trace, step, self.params, self.optimizer, rank_streams(self.case, self.rng_states))
        if self.scheduler is not None:
            for key, value in schedule_state(self.scheduler).items():
                add(step, "resumed", key, value)
        if self.scaler is not None:
            add(step, "resumed", "loss_scale.scale", self.scaler.scale.reshape(1).float())
            add(step, "resumed", "loss_scale.growth_tracker", torch.tensor([self.scaler.good_steps], dtype=torch.int64))

    def begin_step(self, step: int) -> _Step:
        """The step's global batch cut into micro-batches and ranks, and the compute copies of
        the parameters."""
        case = self.case
        inputs, targets = global_batch(case, step)
        per_rank = [microbatch_slices(case, r) for r in range(case.dp_size)]
        groups = [[ranks[m] for ranks in per_rank] for m in range(case.microbatches)]
        if not self.emulate:
            groups = [[torch.cat([torch.arange(s.start, s.stop) for s in g])] for g in groups]
        # The loss is the mean over the step's real tokens: each (virtual) rank scales its sum.
        loss_factor = global_mean_scale(len(groups[0]), item_count(case, targets))
        return _Step(
            step=step,
            inputs=inputs,
            targets=targets,
            groups=groups,
            loss_factor=loss_factor,
            compute=(compute := untie(case, self.compute_copies())),  # a pipeline's tied copies apart
            trainable=[n for n in compute if compute[n].requires_grad],
            logits={},
            rank_loss=[torch.zeros((), dtype=torch.float32) for _ in groups[0]],
            master_grads={},
            local_grads=[{} for _ in groups[0]],
            ignored_grads=[{} for _ in groups[0]],
            fingerprints={},
        )

    def compute_copies(self) -> dict[str, torch.Tensor]:
        """The parameters as the forward computes with them, in `param_dtype`: fresh tensors, or,
        where the engine computes on views of a unit's flat buffer, views of such a buffer at the
        engine's offsets (a matmul's rounding depends on where its weight starts)."""
        if self.views is None:
            dtype = self.compute_dtypes
            return {
                n: p.detach().to(dtype.get(n, self.param_dtype)).requires_grad_(p.requires_grad)
                for n, p in self.params.items()
            }
        compute = self.views.compute(self.params, self.param_dtype)
        return {n: compute[n] for n in self.params}  # in the parameters' order, as above

    # ---- forward and backward ---------------------------------------------------------------------
    def rank_passes(self, state: _Step, group: list, m: int = 0) -> dict[int, RankPass]:
        """Every emulated rank's pass over its slice of one micro-batch: this process's ranks run
        here, the others' (with a `share`) come from the processes that ran them."""
        ranks: dict[int, RankPass] = {}
        for r, index in enumerate(group):
            if self.share is not None and not self.share.mine(r):
                continue  # another process runs this rank (`share.exchange` brings it)
            ranks[r] = self.rank_pass(state, r, index, m)
        if self.share is not None:
            ranks = self.share.exchange(ranks, self.model)
        return ranks

    def rank_pass(self, state: _Step, r: int, index, m: int = 0) -> RankPass:
        """Rank r's forward and backward of its samples `index` (micro-batch m), with its own
        dropout generator (fingerprinted around the forward and after the backward:
        verify/probes/rng.py), the loss scaled by the loss scale when there is one; watched by a
        zoom's probes at its step."""
        if self.watch is None:
            return self._rank_pass(state, r, index)
        with self.watch.rank_pass(state.step, m, r):
            return self._rank_pass(state, r, index)

    def _rank_pass(self, state: _Step, r: int, index) -> RankPass:
        if self.tp is not None:  # its tp ranks side by side (reference/tensor_parallel.py)
            with self.tp.region():
                return self._rank_pass_of(state, r, index)
        if self.held_rows is not None:  # its grouped GEMMs' rows kept for their ep holders
            with self.held_rows.pass_rows() as rows:
                done = self._rank_pass_of(state, r, index)
            done.rows = rows
            return done
        return self._rank_pass_of(state, r, index)

    def _rank_pass_of(self, state: _Step, r: int, index) -> RankPass:
        before = rng_fingerprint(self.rng_states[r])  # each rank's generator around its forward
        torch.set_rng_state(self.rng_states[r])
        args, kwargs = as_call(take(state.inputs, index))
        compute, leaves = self.tp.split(state.compute) if self.tp is not None else (state.compute, None)
        with self.fusion.forward() if self.fusion is not None else contextlib.nullcontext():
            out = functional_call(self.model, compute, args, kwargs, tie_weights=not untied(self.case))
            out = logits_of(self.case.model, out)
        if self.watch is not None:
            self.watch.forward_done()
        after = rng_fingerprint(torch.get_rng_state())
        targets = state.targets[index]
        if self.tp is not None:
            local = out
            loss_of = lambda factor: self.tp.loss(self.case, local, targets, factor)  # noqa: E731
            out = self.tp.whole(out)
        else:
            loss_of = lambda factor: microbatch_loss(self.case, out, targets, factor)  # noqa: E731
        loss = loss_of(state.loss_factor)
        # a pipeline's schedule backpropagates its own (reference/pipeline_parallel.py)
        summed = backward_loss(self.case, loss_of, state.loss_factor, loss)
        if self.case.grad_reduction == "sum":  # the engine sums over the (virtual) ranks: each divides its loss
            summed = summed / len(state.groups[0])
        backpropagated = self.scaler.scaled(summed) if self.scaler is not None else summed
        # A routed expert no sample of this rank's micro-batch reached takes no part in the graph:
        # its gradient is zero, as FSDP2 reduce-scatters it (`set_reduce_scatter_unused_params`).
        with (
            self.fusion.backward_pass() if self.fusion is not None else contextlib.nullcontext(),
            self.recomputing(state),
        ):
            if leaves is None:
                grads = torch.autograd.grad(
                    backpropagated,
                    [state.compute[n] for n in state.trainable],
                    allow_unused=True,
                    materialize_grads=True,
                )
            else:  # against each tp rank's leaf, then put back together
                flat = [leaf for n in state.trainable for leaf in leaves[n]]
                got = torch.autograd.grad(backpropagated, flat, allow_unused=True, materialize_grads=True)
                per = [list(got[i * self.case.tp : (i + 1) * self.case.tp]) for i in range(len(state.trainable))]
                grads = self.tp.gradients(state.trainable, per)
        if self.compute_dtypes:
            # A parameter computed with in another dtype still has FSDP2's unsharded parameter in
            # `param_dtype` beneath it: autograd casts its gradient to that dtype (float8's
            # all-gathered weights: cast from fp32, their gradients bf16 under a bf16 policy).
            grads = [g.to(self.param_dtype) if n in self.compute_dtypes else g for n, g in zip(state.trainable, grads)]
        self.rng_states[r] = torch.get_rng_state()
        backward = rng_fingerprint(self.rng_states[r])  # after its backward (verify/probes/rng.py)
        passed = (out.detach(), loss.detach().float(), before, after, backward)
        return RankPass(dict(zip(state.trainable, grads)), *passed)

    def recomputing(self, state: _Step) -> contextlib.AbstractContextManager:
        """Where the model's units are checkpointed (the compiled reference of a checkpointing
        case, `reference_model`), their forward runs again in backward, outside `functional_call`:
        the model holds the compute copies through the backward too, so the recomputation
        computes with what the forward did (fp32 masters there fail checkpoint's check in bf16)."""
        reparametrize = private_name("torch.nn.utils.stateless", "_reparametrize_module")
        checkpointed = self.case.activation_checkpointing and self.case.compile is not None and self.fusion is None
        if not checkpointed or reparametrize is None:
            return contextlib.nullcontext()
        return reparametrize(self.model, state.compute, tie_weights=not untied(self.case))

    def collect(self, state: _Step, m: int, group: list, ranks: dict[int, RankPass]) -> list[dict[str, torch.Tensor]]:
        """The ranks' passes of micro-batch m taken in rank order, as one process runs them: their
        fingerprints, losses and logits kept for the records; their gradients returned."""
        rank_grads = []
        for r, index in enumerate(group):
            done = ranks[r]
            if self.emulate and self.case.pp == 1:  # verify/probes/rng.py (a pipeline's stages: none)
                for _ in range(self.case.tp):  # every rank's, those of a tp group alike
                    state.fingerprints.setdefault(f"before_forward.{m}", []).append(done.rng_before)
                    state.fingerprints.setdefault(f"after_forward.{m}", []).append(done.rng_after)
                    state.fingerprints.setdefault(f"after_backward.{m}", []).append(done.rng_after_backward)
            rank_grads.append(done.grads)
            state.rank_loss[r] += done.loss
            store_logits(state.logits, index, done.logits)
        if self.held_rows is not None:
            rank_grads = self.held_rows.holders(rank_grads, [ranks[r].rows for r in range(len(group))])
        return rank_grads

    # ---- the reduction ----------------------------------------------------------------------------
    def reduce(self, state: _Step, m: int, rank_grads: list[dict[str, torch.Tensor]]) -> None:
        """Micro-batch m's gradients averaged over the ranks into the fp32 master gradients: at
        once (`sync_every_microbatch`), or each rank's accumulated until the last micro-batch;
        the `ignored` parameters' as the loop reduces them (`reduce_ignored`)."""
        if self.emulates_ep():  # each ep rank's experts: its group's gradients added (reference/expert_parallel.py)
            rank_grads = ep_sums(self.case, rank_grads, self.held_rows.names() if self.held_rows else frozenset())
        if self.case.ignored:
            rank_grads = self.reduce_ignored(state, m, rank_grads)
        if not self.case.sync_every_microbatch:
            # Unsharded accumulation without communication. FSDP2 (FSDPParam.
            # to_accumulated_grad_if_needed / accumulate_unsharded_grad_if_needed) upcasts a
            # no-sync gradient to reduce_dtype when that is set and differs from the compute
            # dtype and adds later micro-batches into it there (fp32 += bf16), so the running
            # sum is in reduce_dtype, not param_dtype as seed 000 describes; with reduce_dtype
            # unset (or equal) autograd accumulates in param_dtype. Both are `reduce_dtype` here.
            for acc, g in zip(state.local_grads, rank_grads):
                for n, t in g.items():
                    acc[n] = acc[n] + t if n in acc else t.to(self.reduce_dtype)
            if m < len(state.groups) - 1:
                return
            rank_grads = state.local_grads
        if self.tp is not None:  # each partial gradient summed over its tp ranks first, as FSDP2 does
            rank_grads = self.tp.combine(rank_grads, self.reduce_dtype)
        if self.layout is not None:  # FSDP1's NO_SHARD reduces the running sum (`FlatLayout.carry`)
            rank_grads = self.layout.carry(rank_grads, state.master_grads)
        if self.defers_replica_reduce():
            last = m == len(state.groups) - 1
            if self.emulates_ep():  # not beside tp (verify/case_rules.py): one partial sum
                averaged = ep_average(
                    rank_grads,
                    self.case,
                    self.reduce_dtype,
                    self.divide,
                    hsdp_average,
                    partial=state.partial.setdefault(0, {}),
                    all_reduce=last,
                )
            else:
                averaged = self._per_tp_rank(
                    lambda grads, t: hsdp_average(
                        grads, self.case, self.reduce_dtype, self.divide, state.partial.setdefault(t, {}), last
                    ),
                    rank_grads,
                )
            for n, avg in averaged.items():
                state.master_grads[n] = avg.to(torch.float32)  # FSDP2 set no gradient before: nothing to add
            return
        for n, avg in self.average(rank_grads, state.step).items():
            reduced = avg.to(torch.float32)
            state.master_grads[n] = state.master_grads[n] + reduced if n in state.master_grads else reduced
        if m == len(state.groups) - 1:
            pp_after_reduction(self.case, state.master_grads)  # a pipeline schedule's scale_grads

    def reduce_ignored(
        self, state: _Step, m: int, rank_grads: list[dict[str, torch.Tensor]]
    ) -> list[dict[str, torch.Tensor]]:
        """`ignored` parameters (fully_shard's `ignored_params`): FSDP2 neither shards nor
        reduces them, so each rank's gradient accumulates in fp32 over the micro-batches
        (autograd's `.grad` sum), and after the last backward the loop all-reduces it over every
        rank, in gloo's order (`gloo_allreduce_sum`), then divides by W under avg
        (`EngineView.reduce_ignored`). Returns the other gradients, for FSDP2's reduction."""
        names = [n for n in rank_grads[0] if is_ignored(self.case.ignored, n)]
        if not names:
            return rank_grads
        for acc, grads in zip(state.ignored_grads, rank_grads):
            for n in names:
                acc[n] = acc[n] + grads[n] if n in acc else grads[n]
        if m == len(state.groups) - 1:
            world = len(state.ignored_grads)
            for n in names:
                terms = [acc[n] for acc in state.ignored_grads]
                total = terms[0]
                if world > 1:
                    total = gloo_allreduce_sum([t.reshape(-1) for t in terms]).view_as(terms[0])
                    total = total if self.case.grad_reduction == "sum" else total / world
                if self.jolt is not None:
                    total = self.jolt.reduction(total, terms, f"{state.step}/grads")
                state.master_grads[n] = total.to(torch.float32)
        return [{n: g for n, g in grads.items() if n not in names} for grads in rank_grads]

    def defers_replica_reduce(self) -> bool:
        """`replica_sync_last` on a 2-D mesh (FSDP2's HSDP: `set_requires_all_reduce(False)` before
        every micro-batch but the last), reduced every micro-batch, FSDP2's arithmetic emulated:
        the replicas' all-reduce waits for the last micro-batch (`hsdp_average`'s `partial`)."""
        case = self.case
        return (
            case.replica_sync_last
            and len(case.mesh) == 2
            and case.sync_every_microbatch
            and self.layout is None
            and self.order == "ring"
            and self.jolt is None
            and self.emulate
        )

    def emulates_ep(self) -> bool:
        return emulates_ep(self.case, self.emulate, self.order, self.layout)

    def average(self, rank_grads: list[dict[str, torch.Tensor]], step: int) -> dict[str, torch.Tensor]:
        """The ranks' gradients averaged in `reduce_dtype` as the engine does (a flat engine's
        buffers, FSDP2's HSDP on a 2-D mesh, or each parameter in `order`), moved by the
        perturbation when there is one."""
        if self.layout is not None:
            averaged = self.layout.average(rank_grads, self.reduce_dtype, self.divide)
        elif self.emulates_ep():
            averaged = ep_average(rank_grads, self.case, self.reduce_dtype, self.divide, hsdp_average)
        elif self.case.pp > 1 and self.order == "ring" and self.emulate:  # each stage reduces its own
            averaged = self._per_tp_rank(
                lambda grads, _t: pp_average(grads, self.case, self.reduce_dtype, self.divide, hsdp_average),
                rank_grads,
            )
        elif self.order == "ring" and len(rank_grads) == self.case.dp_size:
            averaged = self._per_tp_rank(
                lambda grads, _t: hsdp_average(grads, self.case, self.reduce_dtype, self.divide), rank_grads
            )
        else:
            averaged = {
                n: average([g[n] for g in rank_grads], self.reduce_dtype, self.order, self.divide)
                for n in rank_grads[0]
            }
        if self.jolt is not None:
            averaged = {
                n: self.jolt.reduction(avg, [g[n] for g in rank_grads], f"{step}/grads") for n, avg in averaged.items()
            }
        return averaged

    def _per_tp_rank(self, average, rank_grads: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """`average(rank_grads, t)` of the ranks' gradients; under tensor parallelism on each tp
        rank t's local shards, as FSDP2 reduce-scatters them (reference/tensor_parallel.py)."""
        return average(rank_grads, 0) if self.tp is None else self.tp.per_tp_rank(average, rank_grads)

    def hand_grads_to_params(self, state: _Step) -> None:
        """The reduced fp32 gradients become the parameters' `.grad` (the same tensors)."""
        for n, p in self.params.items():
            p.grad = state.master_grads.get(n)

    # ---- after the reduction: loss scale, clip, optimizer -----------------------------------------
    def unscale(self, state: _Step) -> bool:
        """fp16 dynamic loss scaling: the reduced gradients (p.grad) unscaled in place before the
        clip; whether the step is skipped (False without a scaler). Records the scale the step ran
        at and the decision, alike on every rank."""
        if self.scaler is None:
            return False
        scale = self.scaler.scale
        skip = self.scaler.unscale_(list(state.master_grads.values()))  # p.grad, unscaled before the clip
        self.trace.add(state.step, "loss_scale", "scale", scale.repeat(self.case.world_size))
        self.trace.add(
            state.step, "loss_scale", "skipped", torch.full((self.case.world_size,), int(skip), dtype=torch.int64)
        )
        return skip

    def clip(self, state: _Step) -> None:
        """The gradients clipped to `clip_norm` by their global norm, computed as the emulated
        engine computes it (see `train_reference`), moved by the perturbation when there is one;
        records the norm."""
        if self.case.clip_norm is None:
            return
        step = state.step
        named = [(n, p) for n, p in self.params.items() if p.grad is not None]
        with_grad = [p for _, p in named]
        grads = [p.grad for p in with_grad]
        if self.emulate and self.order == "ring" and self.layout is not None:  # the flat engine's own
            norm = self.layout.norm({n: p.grad for n, p in self.params.items() if p.grad is not None})
        elif self.emulate and self.order in ("ring", "rank") and self.case.pp > 1:  # each pp rank's stages, then pp
            shard = self.case.mesh[-1]
            norm = pp_stages_norm(
                self.case,
                named,
                lambda mine: (
                    self.tp.norm([(n, p.grad) for n, p in mine], shard)  # a stage's 2-D gradients
                    if self.tp is not None
                    else norm_from_shards(
                        [p.grad for _, p in mine], shard, [placement_dim(self.case, n, p.shape) for n, p in mine]
                    )
                ),
            )
        elif self.emulate and self.order in ("ring", "rank") and self.tp is not None:  # 2-D gradients
            norm = self.tp.norm([(n, p.grad) for n, p in named], self.case.mesh[-1])
        elif self.emulate and self.order in ("ring", "rank") and self.case.ep > 1:  # two meshes: experts', dense
            shard = self.case.mesh[-1]
            norm = ep_norm(
                self.case,
                [(n, p.grad) for n, p in named],
                lambda dense: norm_from_shards([g for _, g in dense], shard),
            )
        elif self.emulate and self.order in ("ring", "rank"):  # FSDP2's arithmetic; the others sample a flat engine's
            dims = [placement_dim(self.case, n, p.shape) for n, p in named]
            norm = norm_from_shards(grads, self.case.mesh[-1], dims)  # HSDP: the shard group's row chunks
        else:
            norm = torch.nn.utils.get_total_norm(grads[::-1] if self.order == "reverse" else grads)
        if self.jolt is not None:
            norm = self.jolt.norm(norm, grads, f"{step}/grad_norm")
        torch.nn.utils.clip_grads_with_norm_(with_grad, self.case.clip_norm, norm)
        self.trace.add(step, "grad_norm", "total_norm", norm)

    def optimizer_step(self, skip: bool) -> None:
        """The optimizer's step, the loss scale's update and the learning-rate schedule's step
        (after a skipped step too, as the loop steps it); the gradients dropped."""
        if self.scaler is None:
            self.optimizer.step()
        else:  # every rank skips an overflowing step (the found-inf flag is all-reduced)
            if not skip:
                self.optimizer.step()
            self.scaler.update(skip)
        step_scheduler(self.scheduler)
        update_router_biases(self.model)  # as the loop moves them after its step
        self.optimizer.zero_grad(set_to_none=True)

    # ---- the records ------------------------------------------------------------------------------
    def record_passes(self, state: _Step) -> None:
        """What the forward and backward passes and the reduction gave: the generators'
        fingerprints, the logits, the loss, the reduced gradients (scaled, as the engine reduced
        them)."""
        step = state.step
        for name, per_rank in state.fingerprints.items():
            self.trace.add(step, "rng", name, torch.tensor(per_rank, dtype=torch.int64))
        self.trace.add(step, "logits", "logits", torch.cat([state.logits[i] for i in sorted(state.logits)]))
        # As the sharded loop: each rank's sum over micro-batches, summed over ranks, / world size.
        loss = gloo_scalar_sum(state.rank_loss) / len(state.rank_loss)
        if self.jolt is not None:
            loss = self.jolt.reduction(loss, state.rank_loss, f"{step}/loss")
        self.trace.add(step, "loss", "loss", loss)
        for n, g in state.master_grads.items():
            self.trace.add(step, "grads", n, g)  # scaled, as the engine reduced them

    def record_state(self, step: int) -> None:
        """The state after the step: parameters (and their sums), buffers, optimizer state."""
        record_params(self.trace, step, self.params)
        record_buffers(self.trace, step, self.model)
        for key, value in optimizer_state(self.optimizer, self.params).items():
            self.trace.add(step, "optim_state", key, value)

    def finish(self) -> Trace:
        """The trace, with the records the perturbation moved directly."""
        if self.jolt is not None:
            self.trace.meta["moved"] = sorted(self.jolt.moved)
        if self.watch is not None:
            self.watch.into(self.trace)
        return self.trace


def _watch(case: Case, model: nn.Module) -> ModuleWatch | None:
    """A zoom's probes on `model` (verify/zoom/watch.py), or None without a zoom."""
    if case.zoom is None:
        return None
    skip = ("",) if case.pp > 1 else ()  # a pipeline's ranks call its stages, never its root
    tp = (case.tp, tp_locals) if case.tp > 1 else ()  # under tp a pass is its tp ranks', one local each
    return ModuleWatch(model, case.zoom, *tp, skip=skip)


def _fusion(case: Case, model: nn.Module, fusion: FusionJolt | None) -> FusionJolt | None:
    """`fusion` counting the forward's depth in what the case compiles, on `model`."""
    if fusion is not None:
        from fsdp_verify.training.compile import compiled_modules

        fusion.attach([module for _, module in compiled_modules(case, model)])
    return fusion
