"""The bug zoo: injected bugs the toolkit must catch, each a small mutation of a correct FSDP2 run
(verify/zoo/mutants.py) drawn from a real report or seed document. `fsdp-verify selftest` draws
cases for each from its pinned strategy and counts how many it takes to catch it.

Pins narrow `fsdp_verify.properties.strategies.cases` to the cases where the bug can show at all (sync only
on the last micro-batch for a bug in that path, clipping on for a clipping bug, two ranks or more
for a reduction bug), never to the cases where it happens to show. Even so, not every case can
expose every bug (a rank that re-initialises but holds no element of any parameter, as when all
widths are 1, changes nothing), which is why the self-test counts the cases it took. Most bugs
are drawn on MLPs only, to keep an example cheap; the tied-weight bug needs the Transformer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from fsdp_verify.torch_support import COMM_CONTRACT, ZOO_COMM, part_off_note

MULTI_RANK = (2, 3, 4)


@dataclass(frozen=True)
class ZooBug:
    name: str
    engine: str  # "fsdp_verify.zoo.mutants:NAME"
    description: str
    source: str  # the real report or seed it comes from
    catchers: tuple[str, ...]  # phases (or check comparators) expected to catch it
    world_sizes: tuple[int, ...] = MULTI_RANK
    precisions: tuple[str, ...] = ("fp32", "bf16")
    model_kinds: tuple[str, ...] = ("mlp",)
    pins: dict[str, Any] = field(default_factory=dict)
    needs: tuple[str, ...] = ()  # parts of the toolkit a torch may lack (torch_support: ZOO_COMM)
    # A bug around a framework's own code (verify/zoo/torchtitan.py): (framework, its model as
    # `--model` spells it there, the factory's keywords); its case fields come from the
    # framework's preset when the strategy is built, not at import.
    framework: tuple[str, str, tuple[tuple[str, Any], ...]] | None = None

    def off_here(self) -> str | None:
        """Why this torch cannot show the bug (a part it needs is off: its mutant cannot be built,
        or the contract that catches it is off; the framework it is planted in is not
        installed), or None."""
        if self.framework is not None:
            import importlib.util

            if importlib.util.find_spec(self.framework[0]) is None:
                from fsdp_verify.frameworks import FRAMEWORKS

                return f"{self.framework[0]} is not installed ({FRAMEWORKS[self.framework[0]]})"
        needs = self.needs + ((COMM_CONTRACT,) if "comm" in self.catchers else ())
        return next((why for why in map(part_off_note, needs) if why), None)

    def strategy(self, world_sizes: tuple[int, ...] | None = None):
        """The pinned case strategy; `world_sizes` narrows the bug's own (e.g. to 2 in CI)."""
        from fsdp_verify.properties.strategies import cases

        sizes = tuple(w for w in self.world_sizes if world_sizes is None or w in world_sizes)
        if not sizes:
            raise ValueError(f"{self.name}: none of world sizes {world_sizes} can show it (needs {self.world_sizes})")
        pins = dict(self.pins)
        if self.framework is not None:
            from fsdp_verify.frameworks import preset

            name, model, kwargs = self.framework
            tp, pp = (isinstance(pins.get(d), int) and pins[d] > 1 for d in ("tp", "pp"))  # a bug in its tp or pp
            fields = preset(name, model, dict(kwargs), tp=tp, pp=pp)
            pins = {**{k: v for k, v in fields.items() if k != "engine"}, **pins}
        return cases(
            engine=self.engine,
            world_sizes=sizes,
            precisions=self.precisions,
            model_kinds=self.model_kinds,
            **pins,
        )


def _mutant(name: str) -> str:
    return f"fsdp_verify.zoo.mutants:{name}"


_MICROBATCHES = st.integers(2, 3)
# One case per example costs ~0.2-1 s; keep the zoo's cases at the cheap end.
_CHEAP = {"steps": st.integers(1, 2)}
# Lengths drawn in [1, seq_len] differ between micro-batches and ranks only if seq_len > 1; the
# normalisation bugs cannot show otherwise (equal token counts make them correct).
_FSDP1 = {"precision.output_dtype": None, "sync_every_microbatch": True}
_PADDED = {"data.padded": True, "model.seq_len": st.integers(4, 8), "model.dropout": 0.0}

# A checkpoint and resume drawn in every case (docs/resume.md): the bug is in the load.
_RESUME = {**_CHEAP, "resume": True}

ZOO: list[ZooBug] = [
    ZooBug(
        "grads_divided_twice",
        _mutant("grads_divided_twice"),
        "gradients averaged over ranks, then divided by the world size once more",
        "a manual `/ world_size` on top of ReduceOp.AVG (DDP/FSDP migration reports)",
        ("grads",),
        pins=dict(_CHEAP),
    ),
    ZooBug(
        "group_sharded_module_by_module",
        _mutant("group_sharded_module_by_module"),
        "a unit over several modules sharded as one unit a module",
        "torchtitan's fully_shard([norm, lm_head]) walked module by module (issue 49)",
        ("build",),
        pins={**_CHEAP, "wrap": ("layers.0+layers.1", ""), "model.widths": (8, 6, 5, 4)},
    ),
    ZooBug(
        "grads_not_averaged",
        _mutant("grads_not_averaged"),
        "gradients summed over ranks, never divided by the world size",
        "gradient divide factor 1 / SUM reduce op (FSDP2 set_gradient_divide_factor misuse)",
        ("grads",),
        pins=dict(_CHEAP),
    ),
    ZooBug(
        "reduce_in_bf16",
        _mutant("reduce_in_bf16"),
        "reduce_dtype dropped: gradients reduce-scattered in bf16 although the policy says fp32",
        "seed 000: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32); bf16 reductions lose"
        " the small contributions (1e7 + 1 - 1e7 + 1)",
        ("precision", "grads"),
        precisions=("bf16",),
        pins={**_CHEAP, "precision.reduce_dtype": "float32", "data.kind": "cancellation"},
    ),
    ZooBug(
        "param_dtype_ignored",
        _mutant("param_dtype_ignored"),
        "param_dtype dropped: forward and backward run in fp32 although the policy says bf16",
        "seed 000: unsharded params in param_dtype; a policy that never reaches fully_shard",
        ("precision", "logits", "loss"),
        world_sizes=(1, 2, 3, 4),
        precisions=("bf16",),
        pins=dict(_CHEAP),
    ),
    ZooBug(
        "master_weights_in_bf16",
        _mutant("master_weights_in_bf16"),
        "the model cast to bf16 before sharding: master weights, gradients and optimizer state in bf16",
        "seed 000/001: sharded master weights stay fp32; `model.to(torch.bfloat16)` before fully_shard",
        ("precision",),
        world_sizes=(1, 2, 3, 4),
        pins=dict(_CHEAP),
    ),
    ZooBug(
        "microbatch_accumulation_overwrites",
        _mutant("microbatch_accumulation_overwrites"),
        "each micro-batch's gradient replaces the accumulated one instead of adding to it",
        "`grad = new` for `grad += new` / zero_grad inside the accumulation loop (seed 000's"
        " loss * dp_size / global_batch_size accumulation)",
        ("grads",),
        world_sizes=(1, 2, 3, 4),
        pins={**_CHEAP, "microbatches": _MICROBATCHES, "sync_every_microbatch": True},
    ),
    ZooBug(
        "grad_sync_off_on_last_microbatch",
        _mutant("grad_sync_off_on_last_microbatch"),
        "accumulating without communication, gradient sync is never turned back on for the last"
        " micro-batch: nothing is reduced",
        "seed 000: local accumulation in bf16, reduce-scatter on the last micro-batch only"
        " (`no_sync` wrapping the final backward)",
        ("grads",),
        world_sizes=(1, 2, 3, 4),
        pins={**_CHEAP, "microbatches": _MICROBATCHES, "sync_every_microbatch": False},
    ),
    ZooBug(
        "checkpoint_without_rng_state",
        _mutant("checkpoint_without_rng_state"),
        "activation checkpointing with preserve_rng_state=False: backward recomputes dropout with new masks",
        "issue 11: activation checkpointing that recomputes dropout with another RNG state",
        ("grads", "rng"),
        world_sizes=(1, 2, 3, 4),
        pins={**_CHEAP, "model.dropout": st.sampled_from((0.1, 0.5)), "activation_checkpointing": False},
    ),
    ZooBug(
        "clip_with_local_norm",
        _mutant("clip_with_local_norm"),
        "gradients clipped by each rank's local norm, not the global one",
        "seed 001: local norms 2.236, 5, 7.81, 10.63; the global norm is 14.283, not 10.63",
        ("grad_norm",),
        pins={**_CHEAP, "clip_norm": st.sampled_from((1e-3, 1e-2))},
    ),
    ZooBug(
        "rank1_different_init",
        _mutant("rank1_different_init"),
        "rank 1 initialises its parameters differently and nothing synchronises them",
        "seed 004: CPU vs CUDA generators, trunc_normal_ draws, meta-device init consuming RNG",
        ("init",),
        pins=dict(_CHEAP),
    ),
    ZooBug(
        "tie_broken_by_sharding",
        _mutant("tie_broken_by_sharding"),
        "the output head tied to the embedding gets its own copy when sharding; they train apart",
        "seed 003: shared params must sit in one FSDP unit; tied embeddings untied by re-registration",
        ("ownership", "init", "params", "grads", "param_sums"),
        model_kinds=("transformer",),
        pins={**_CHEAP, "model.tie_embeddings": True, "model.frozen": ()},
    ),
    ZooBug(
        "frozen_params_move",
        _mutant("frozen_params_move"),
        "frozen (requires_grad=False) parameters get gradients and the optimizer moves them",
        "FSDP1 use_orig_params=False flat parameters mixing frozen and trainable weights",
        ("grads", "params"),
        world_sizes=(1, 2, 3, 4),
        pins={**_CHEAP, "model.frozen": ("layers.0.linear.weight",)},
    ),
    ZooBug(
        "grad_sync_off_for_one_unit",
        _mutant("grad_sync_off_for_one_unit"),
        "gradient sync left off for one shard unit (a `no_sync` that never ended)",
        "FSDP no_sync / set_requires_gradient_sync misuse",
        ("grads",),
        pins=dict(_CHEAP),
    ),
    ZooBug(
        "inputs_cast_to_bf16",
        _mutant("inputs_cast_to_bf16"),
        "floating inputs rounded through bf16 although the policy is full precision",
        "seed 000: autocast-style casts outside the policy",
        ("logits",),
        world_sizes=(1, 2, 3, 4),
        precisions=("fp32",),
        pins=dict(_CHEAP),
    ),
    ZooBug(
        "loss_normalised_per_microbatch",
        _mutant("loss_normalised_per_microbatch"),
        "each micro-batch's loss is its own token mean, averaged over micro-batches: with padded"
        " sequences of different lengths, tokens of short micro-batches weigh more",
        "seed 000: scale the loss by dp_size / global_batch_tokens for accumulation, not per micro-batch",
        ("loss", "grads"),
        world_sizes=(1, 2, 3, 4),
        model_kinds=("transformer",),
        pins={**_CHEAP, **_PADDED, "microbatches": _MICROBATCHES},
    ),
    ZooBug(
        "loss_normalised_per_rank",
        _mutant("loss_normalised_per_rank"),
        "each rank's loss is the mean over its own tokens, then averaged over ranks: with padded"
        " sequences, ranks holding fewer real tokens weigh each token more",
        "seed 000: loss_sum * dp_size / global_batch_tokens, each rank summing its own tokens",
        ("loss", "grads"),
        model_kinds=("transformer",),
        pins={**_CHEAP, **_PADDED},
    ),
    ZooBug(
        "all_reduce_instead_of_reduce_scatter",
        _mutant("all_reduce_instead_of_reduce_scatter"),
        "gradients all-reduced in full, each rank keeping its shard: the right sums at twice the bytes",
        "seed 001: per step a reduce-scatter of the gradients, not an all-reduce (DDP habits in FSDP)",
        ("comm",),
        # At two ranks an all-reduce adds in the reduce-scatter's order (a + b = b + a): the numbers
        # are bit for bit the correct engine's, so only the contract can tell.
        world_sizes=(2,),
        pins=dict(_CHEAP),
        needs=(ZOO_COMM,),
    ),
    ZooBug(
        "all_gather_in_fp32",
        _mutant("all_gather_in_fp32"),
        "parameters all-gathered in fp32 under a bf16 policy, cast to bf16 after the gather",
        "seed 001: the all-gather moves param_dtype (7B model, 4 ranks: 14 GB, not 28 GB, per gather)",
        ("comm",),
        precisions=("bf16",),
        pins=dict(_CHEAP),
        needs=(ZOO_COMM,),
    ),
    ZooBug(
        "retains_full_params",
        _mutant("retains_full_params"),
        "the unsharded parameters kept alive after sharding: a full replica on every rank",
        "seeds 003/004: 1/N of the weights per rank (3.9x less at 8 ranks), unsharded only while computing",
        ("memory",),
        world_sizes=(1, 2, 3, 4),
        pins=dict(_CHEAP),
    ),
    ZooBug(
        "inf_check_not_all_reduced",
        _mutant("inf_check_not_all_reduced"),
        "fp16 loss scaling whose found-inf flag is not all-reduced: the rank holding an overflowing"
        " shard skips the step, another steps",
        "seed 002: every rank skips a step when any saw an inf/NaN; a scaler that unscales the local"
        " shards (`to_local()`) bypasses DTensor's all-reduce of the found-inf flag",
        ("loss_scale",),
        precisions=("fp16",),
        # The ranks can only disagree when the overflow is confined to some ranks' shards (an inf
        # in a rank's local gradient reaches every shard through the reduction when it is in the
        # logits' gradient). Inputs 100x the activations make the first layer's gradient the
        # largest by far, so a growing scale overflows it (its live rows, a subset of the shards)
        # before anything else: 9 of 40 drawn cases against 3 of 40 over all data scales.
        pins={**_CHEAP, "data.scale": 100.0},
    ),
    ZooBug(
        "unscale_after_clipping",
        _mutant("unscale_after_clipping"),
        "fp16 loss scaling that clips the scaled gradients and unscales afterwards: clipped by a"
        " norm `scale` times too large",
        "seed 002 / the AMP docs: unscale_ before clip_grad_norm_",
        ("grad_norm",),
        world_sizes=(1, 2, 3, 4),
        precisions=("fp16",),
        pins={**_CHEAP, "clip_norm": st.sampled_from((1e-3, 1e-2))},
    ),
    ZooBug(
        "flat_nested_double_ownership",
        _mutant("flat_nested_double_ownership"),
        "the root's FlatParameter collects parameters(recurse=True): wrapped children's params held twice",
        "seed 004, finding 4 (the parameter sum doubled after wrapping)",
        ("ownership", "param_sums"),
        world_sizes=(1, 2, 3, 4),
        pins=dict(_CHEAP),
    ),
    ZooBug(
        "flat_meta_init_consumes_rng",
        _mutant("flat_meta_init_consumes_rng"),
        "meta-device build that consumes random numbers before initialisation (RNG not restored)",
        "seed 004, finding 3",
        ("init",),
        world_sizes=(1, 2, 3, 4),
        pins={**_CHEAP, "init": "meta"},
    ),
    # FSDP1's hybrid and NO_SHARD strategies (verify/engines/fsdp1.py): the mesh is the bug's
    # precondition. FSDP1 has no output_dtype; no-sync is left on so that FSDP1's one gap the
    # reference does not model (no-sync bf16 accumulation, `fsdp1_modelled`) cannot be the catch.
    ZooBug(
        "fsdp1_hybrid_replicas_not_reduced",
        _mutant("fsdp1_hybrid_replicas_not_reduced"),
        "FSDP1 on a (replicate, shard) mesh as FULL_SHARD over the shard group: each replica group"
        " averages and steps on its own gradients",
        "HSDP set up by passing the intra-node group alone (FSDP1 HYBRID_SHARD's process_group tuple)",
        ("grads",),
        world_sizes=(4,),
        pins={**_CHEAP, **_FSDP1, "mesh_shape": (2, 2)},
    ),
    ZooBug(
        "fsdp1_hybrid_divides_by_shard_group",
        _mutant("fsdp1_hybrid_divides_by_shard_group"),
        "FSDP1 HYBRID_SHARD dividing the gradient by the shard group's size, not the data-parallel world's",
        "FSDP1 HSDP's divide factors before the replicate group's size was multiplied in",
        ("grads",),
        world_sizes=(4,),
        pins={**_CHEAP, **_FSDP1, "mesh_shape": (2, 2)},
    ),
    ZooBug(
        "fsdp1_no_shard_not_all_reduced",
        _mutant("fsdp1_no_shard_not_all_reduced"),
        "FSDP1 HYBRID_SHARD on a (W, 1) mesh: NO_SHARD over the shard group of one, never all-reduced"
        " over the replicas (each rank's own gradient / W)",
        "torch 2.13's own behaviour (tests/upstream/test_fsdp1_hybrid_shard_group_of_one.py)",
        ("grads",),
        world_sizes=(2,),
        pins={**_CHEAP, **_FSDP1, "mesh_shape": (2, 1)},
    ),
    ZooBug(
        "fsdp1_no_shard_divides_by_wrong_world",
        _mutant("fsdp1_no_shard_divides_by_wrong_world"),
        "FSDP1 NO_SHARD dividing the all-reduced sum by one rank fewer than it adds",
        "a world size taken without the rank itself (DDP/FSDP migration reports)",
        ("grads",),
        world_sizes=(2,),
        pins={**_CHEAP, **_FSDP1, "mesh_shape": (2, 1)},
    ),
    # fully_shard's knobs (issue 28, items 1-4)
    ZooBug(
        "offload_grad_added_twice",
        _mutant("offload_grad_added_twice"),
        "under CPU offload the reduced gradient is added to the CPU copy and again from the device copy",
        "issue 28: offload_policy=CPUOffloadPolicy (seed 000's configuration), an offloaded gradient stepped twice",
        ("grads",),
        world_sizes=(1, 2, 3, 4),
        pins={**_CHEAP, "offload": True},
    ),
    ZooBug(
        "shard1_cut_on_dim0",
        _mutant("shard1_cut_on_dim0"),
        "a Shard(1) parameter's local shard holds the rank's dim-0 rows (cut on the wrong dimension)",
        "issue 28: shard_placement_fn=Shard(1), a shard padded and cut on the wrong dimension",
        ("init",),
        pins={**_CHEAP, "shard_placement": "dim1"},
    ),
    ZooBug(
        "replica_all_reduce_skipped_on_last",
        _mutant("replica_all_reduce_skipped_on_last"),
        "HSDP accumulation whose replica all-reduce, off for the earlier micro-batches, is skipped on the last too",
        "issue 28: set_requires_all_reduce(False) for accumulation, never turned back on",
        ("grads",),
        world_sizes=(4,),
        pins={
            **_CHEAP,
            "mesh_shape": (2, 2),
            "microbatches": _MICROBATCHES,
            "sync_every_microbatch": True,
            "replica_sync_last": True,
        },
    ),
    ZooBug(
        "replica_all_reduce_every_microbatch",
        _mutant("replica_all_reduce_every_microbatch"),
        "HSDP accumulation asked for, but the replicas all-reduce on every micro-batch (R - 1 too many per unit)",
        "issue 28: set_requires_all_reduce never called; the same average, more traffic",
        ("comm",),
        world_sizes=(4,),
        pins={
            **_CHEAP,
            "mesh_shape": (2, 2),
            "microbatches": _MICROBATCHES,
            "sync_every_microbatch": True,
            "replica_sync_last": True,
        },
    ),
    ZooBug(
        "unsharded_kept_after_the_last_backward",
        _mutant("unsharded_kept_after_the_last_backward"),
        "accumulation that stops resharding after backward and never starts again: every unit unsharded"
        " after the optimizer step, stale in the next step's forward",
        "issue 28: set_reshard_after_backward(False) for accumulation, never turned back on",
        ("grads", "memory"),
        pins={**_CHEAP, "microbatches": _MICROBATCHES, "reshard_after_backward_last": True},
    ),
    ZooBug(
        "reshard_after_backward_ignored",
        _mutant("reshard_after_backward_ignored"),
        "parameters kept unsharded between micro-batches asked for, but every backward reshards and every"
        " forward all-gathers again",
        "issue 28: set_reshard_after_backward never called; the same numbers, the saved all-gathers on the wire",
        ("comm",),
        pins={**_CHEAP, "microbatches": _MICROBATCHES, "reshard_after_backward_last": True},
    ),
    ZooBug(
        "sum_reduction_loss_not_divided",
        _mutant("sum_reduction_loss_not_divided"),
        "gradients summed over ranks (set_gradient_divide_factor(1.0)) but the loss not divided by the"
        " world size: every gradient W times the average",
        "issue 28: the legitimate use of set_gradient_divide_factor, half done",
        ("grads",),
        pins={**_CHEAP, "grad_reduction": "sum"},
    ),
    ZooBug(
        "sum_reduction_factor_left_at_avg",
        _mutant("sum_reduction_factor_left_at_avg"),
        "each rank's loss divided by the world size for a SUM reduction, but the divide factor left at"
        " FSDP2's AVG: every gradient 1/W of the average",
        "issue 28: the legitimate use of set_gradient_divide_factor, the engine's half forgotten",
        # named at the build, before the gradients it would make 1/W: a knob not applied (issue 37)
        ("build",),
        pins={**_CHEAP, "grad_reduction": "sum"},
    ),
    ZooBug(
        "ignored_grads_not_reduced",
        _mutant("ignored_grads_not_reduced"),
        "parameters kept out of FSDP (ignored_params) whose gradients the loop never all-reduces: each rank"
        " steps its own, the ranks drift apart",
        "issue 28: fully_shard's ignored_params, a replicated module left unsynchronised",
        ("grads",),
        precisions=("fp32",),
        pins={
            **_CHEAP,
            "ignored": ("layers.1",),
            "clip_norm": None,
            "model.widths": (16, 33, 17, 8),
            "model.experts": 0,
        },
    ),
    ZooBug(
        "prefetch_one_unit_too_many",
        _mutant("prefetch_one_unit_too_many"),
        "explicit prefetching k units ahead asked for, the forward lists built k + 1 ahead: the same collectives,"
        " one more unit's gathered parameters held at once in forward",
        "issue 28: set_modules_to_forward_prefetch off by one (torchtitan's recipe generalised to k)",
        ("memory",),
        # three layers each wrapped (the default plan): a list one longer reaches a unit more
        pins={**_CHEAP, "prefetch": 1, "wrap": None, "model.widths": (16, 33, 17, 8)},
    ),
]

# Optimizers, schedules and what is trained (docs/optimizers-and-schedules.md): each shows only
# with its knob on (a schedule, an optimizer with state beyond Adam's, an unfreeze step).
ZOO += [
    ZooBug(
        "lr_scheduler_stepped_twice",
        _mutant("lr_scheduler_stepped_twice"),
        "the learning-rate schedule stepped twice per optimizer step: it runs twice as fast",
        "`scheduler.step()` inside the accumulation loop and again after `optimizer.step()`",
        ("params",),
        world_sizes=(1, 2, 3, 4),
        # The rate of step 1 is the initial one: a second step is the first the schedule moves.
        pins={"steps": st.integers(2, 3), "optim.schedule": st.sampled_from(("exponential", "linear_warmup"))},
    ),
    ZooBug(
        "optimizer_state_known_keys_only",
        _mutant("optimizer_state_known_keys_only"),
        "optimizer state beyond SGD's and Adam's (Adagrad's sum, RMSprop's square average,"
        " AMSGrad's running max) reset to zero after every step",
        "an optimizer-state offload or resharding written for Adam (issue 28: state not shaped like Adam's)",
        ("optim_state", "params"),
        world_sizes=(1, 2, 3, 4),
        pins={
            **_CHEAP,
            "optim.name": st.sampled_from(("adagrad", "rmsprop", "adam", "adamw")),
            "optim.amsgrad": True,
        },
    ),
    ZooBug(
        "unfreeze_misses_sharded_params",
        _mutant("unfreeze_misses_sharded_params"),
        "parameters unfrozen through references taken before sharding: the sharded ones stay frozen, never train",
        "a fine-tuning callback that collected `model.named_parameters()` before `fully_shard` replaced them",
        ("grads",),
        world_sizes=(1, 2, 3, 4),
        pins={"steps": st.integers(2, 3), "model.frozen": ("layers.0.linear.weight",), "unfreeze_step": 2},
    ),
    ZooBug(
        "idle_expert_grads_dropped",
        _mutant("idle_expert_grads_dropped"),
        "a routed expert no sample of a micro-batch reached drops the gradient earlier micro-batches accumulated",
        "issue 28: parameters that only some micro-batches use (MoE experts freeing idle gradients)",
        # The memory contract may see it first: after a drop the rank held more gradient bytes than
        # its shards allow (measured 64 B against 32 B at world size 2; FSDP2 allocates a new one).
        ("grads", "memory"),
        world_sizes=(1, 2, 3, 4),
        pins={**_CHEAP, "model.experts": st.sampled_from((2, 3)), "microbatches": _MICROBATCHES},
    ),
    ZooBug(
        "fresh_optimizer_after_resume",
        _mutant("fresh_optimizer_after_resume"),
        "resumes with the model loaded and a fresh optimizer (Adam's moments zero)",
        "a resume that restores model.load_state_dict only (issue 29)",
        ("resumed",),
        pins={**_RESUME, "optim.name": st.sampled_from(("adam", "adamw"))},
    ),
    ZooBug(
        "adam_step_reset_on_resume",
        _mutant("adam_step_reset_on_resume"),
        "resumes with Adam's step count reset to 0: its bias correction restarts",
        "a per-parameter `step` re-created on resume (issue 29)",
        ("resumed",),
        pins={**_RESUME, "optim.name": st.sampled_from(("adam", "adamw"))},
    ),
    ZooBug(
        "prefixed_key_dropped_on_resume",
        _mutant("prefixed_key_dropped_on_resume"),
        "a parameter named with a wrapper's prefix (`_orig_mod.`) on the loading side, dropped by a"
        " non-strict load: it keeps its initial values",
        "strict=False / allow_partial_load hiding a renamed key (issue 29)",
        ("resumed",),
        pins={**_RESUME, "model.frozen": ()},
    ),
    ZooBug(
        "rng_not_restored_on_resume",
        _mutant("rng_not_restored_on_resume"),
        "resumes without the ranks' generators: dropout masks from a fresh seed",
        "RNG state left out of the checkpoint (issue 29)",
        ("resumed",),
        pins={**_RESUME, "model.dropout": 0.1},
    ),
    ZooBug(
        "loss_scale_reset_on_resume",
        _mutant("loss_scale_reset_on_resume"),
        "resumes with a new GradScaler: the scale back at init_scale",
        "the scaler's state_dict left out of the checkpoint (issue 29)",
        ("resumed",),
        precisions=("fp16",),
        pins={**_RESUME, "loss_scaling.growth_interval": 1},
    ),
    ZooBug(
        "data_position_reset_on_resume",
        _mutant("data_position_reset_on_resume"),
        "resumes with the data from the beginning: step 1's batch seen twice",
        "a data loader's position not restored (issue 29)",
        ("resumed",),
        pins=dict(_RESUME),
    ),
    # Slips of a loop's load that a user brought (issue 38): each named right after the load,
    # by a hint that tests its cause against the records (verify/hints.py).
    ZooBug(
        "optimizer_state_swapped_on_resume",
        _mutant("optimizer_state_swapped_on_resume"),
        "the optimizer state of two parameters of the same shape lands on each other",
        "a state dict keyed by position loaded into an optimizer listing its parameters in another order (issue 38)",
        ("resumed",),
        # two layers of the same output width: their biases (and, square, their weights) alike
        pins={
            **_RESUME,
            "optim.name": st.sampled_from(("adam", "adamw")),
            "model.widths": st.tuples(st.integers(1, 16), st.integers(2, 16)).map(lambda t: (t[0], t[1], t[1])),
            "model.frozen": (),
        },
    ),
    ZooBug(
        "optimizer_state_in_bf16_on_resume",
        _mutant("optimizer_state_in_bf16_on_resume"),
        "every float optimizer state rounded through bf16 by the load",
        "a checkpoint that stored the optimizer's moments in bf16 (issue 38)",
        ("resumed",),
        pins={**_RESUME, "optim.name": st.sampled_from(("adam", "adamw"))},
    ),
    ZooBug(
        "weights_loaded_on_rank0_only",
        _mutant("weights_loaded_on_rank0_only"),
        "only rank 0 takes the loaded weights; the other ranks keep the fresh model's shards",
        "an `if rank == 0` left from a full-state-dict load whose broadcast was removed (issue 38)",
        ("resumed",),
        pins=dict(_RESUME),
    ),
    ZooBug(
        "weight_decay_from_the_code_on_resume",
        _mutant("weight_decay_from_the_code_on_resume"),
        "the resumed optimizer's param groups take the code's weight_decay (0) over the saved one",
        "a loop that re-applies its optimizer config after the load (issue 38)",
        ("resumed",),
        pins={
            **_RESUME,
            "optim.name": st.sampled_from(("adamw", "sgd")),
            "optim.weight_decay": st.sampled_from((0.01, 0.1)),
        },
    ),
    ZooBug(
        "scheduler_not_restored_on_resume",
        _mutant("scheduler_not_restored_on_resume"),
        "resumes with a fresh lr scheduler: the schedule restarts from step 0",
        "scheduler.state_dict() left out of the checkpoint (issue 29)",
        ("resumed",),
        pins={**_RESUME, "optim.schedule": st.sampled_from(("exponential", "linear_warmup"))},
    ),
    # torch.compile (issue 41, docs/compile.md): aot_eager, Dynamo and AOTAutograd without Inductor's
    # code generation, shows each of these (what they get wrong is traced, not generated) at a
    # fraction of Inductor's cost; no dropout where the compiled and eager runs are compared.
    ZooBug(
        "compiled_backward_differs",
        _mutant("compiled_backward_differs"),
        "a custom autograd matmul whose compiled backward returns another gradient than eager's (correct sharding)",
        "pytorch/pytorch#184113: torch.compile changed the gradients of a custom autograd matmul (high"
        " priority, silent); a compiler's bug, named the compiler's by the compiled-against-eager check",
        ("compiler",),
        world_sizes=(1, 2, 3, 4),
        pins={
            **_CHEAP,
            "model": "fsdp_verify.zoo.mutants:custom_function_lm",
            "compile": "model",
            "compile_backend": "aot_eager",
        },
    ),
    ZooBug(
        "unit_compiled_with_unsharded_params",
        _mutant("unit_compiled_with_unsharded_params"),
        "each unit compiled before fully_shard as a function of its unsharded parameters: stale weights,"
        " gradients to tensors the optimizer does not hold",
        "a functional compile of each block ahead of sharding (`functional_call` with the block's parameters"
        " as they are then), torchtitan's compile-before-fully_shard order gone wrong",
        ("grads",),
        world_sizes=(1, 2, 3, 4),
        precisions=("fp32",),
        pins={**_CHEAP, "compile": "units", "compile_backend": "aot_eager", "model.widths": st.just((7, 5, 3))},
    ),
    ZooBug(
        "hook_dropped_by_compile",
        _mutant("hook_dropped_by_compile"),
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
    ),
    ZooBug(
        "recompiles_every_step",
        _mutant("recompiles_every_step"),
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
    ),
]

# Tensor parallelism (issue 39): a tp degree of 2 (world sizes 2 and 4: meshes (1, 2) and (2, 2)).
_TP = {**_CHEAP, "tp": 2}
_TP_WORLDS = (2, 4)

ZOO += [
    ZooBug(
        "tp_norm_grad_not_reduced",
        _mutant("tp_norm_grad_not_reduced"),
        "under sequence parallelism a norm's weight gradient is each tp rank's partial sum, never summed over tp",
        "issue 39: Megatron's `sequence_parallel` parameter attribute forgotten (a hand-written SP norm)",
        ("grads",),
        world_sizes=_TP_WORLDS,
        model_kinds=("transformer",),
        pins={**_TP, "sequence_parallel": True, "clip_norm": None},  # norms off the tp mesh: no clip
    ),
    ZooBug(
        "rowwise_output_not_all_reduced",
        _mutant("rowwise_output_not_all_reduced"),
        "a row-parallel linear's partial output used as it is, never all-reduced over tp",
        "issue 39: the reduction of a RowwiseParallel output hook forgotten",
        ("logits",),
        world_sizes=_TP_WORLDS,
        model_kinds=("mlp", "transformer"),
        pins={**_TP, "sequence_parallel": False},
    ),
    ZooBug(
        "tp_grad_all_reduce_in_bf16",
        _mutant("tp_grad_all_reduce_in_bf16"),
        "the norms' partial gradients summed over tp in bf16 while reduce_dtype is fp32",
        "issue 39, pytorch/pytorch#190626 (FSDP2's own, torch 2.13; here by hand)",
        ("grads", "comm"),  # the contract sees the all-reduce's dtype at step 0
        world_sizes=_TP_WORLDS,
        precisions=("bf16",),
        model_kinds=("transformer",),
        pins={**_TP, "sequence_parallel": True, "precision.reduce_dtype": "fp32", "clip_norm": None},
    ),
    ZooBug(
        "fsdp_over_tp_dim",
        _mutant("fsdp_over_tp_dim"),
        "the mesh's dims swapped: the plan over the data-parallel dim, fully_shard over tp",
        "issue 39: a mesh built as (dp, tp) read as (tp, dp)",
        ("build", "comm"),  # the contract sees each collective's group on the wrong mesh dim
        world_sizes=_TP_WORLDS,
        model_kinds=("mlp", "transformer"),
        pins=dict(_TP),
    ),
    ZooBug(
        "dp_and_tp_dims_swapped",
        _mutant("dp_and_tp_dims_swapped"),
        "the world mesh's data-parallel and tp dims swapped: a tp group spans ranks of different batches",
        "issue 50: a hand-built DeviceMesh whose degrees are listed in another order than its names",
        ("logits", "grads"),
        world_sizes=(4,),
        model_kinds=("mlp", "transformer"),
        pins={**_TP, "mesh_shape": None},
    ),
    ZooBug(
        "colwise_bias_replicated",
        _mutant("colwise_bias_replicated"),
        "a column-parallel linear's bias left whole: every tp rank adds the bias's first chunk",
        "issue 39: a bias not split with its weight (a hand-written ColwiseParallel)",
        ("init",),
        world_sizes=_TP_WORLDS,
        pins=dict(_TP),
    ),
    ZooBug(
        "loss_parallel_without_vocab_reduction",
        _mutant("loss_parallel_without_vocab_reduction"),
        "loss parallelism's log-softmax over each rank's vocabulary shard alone (no max or sum over tp)",
        "issue 39: a vocab-parallel cross-entropy missing its all-reduces",
        ("loss",),
        world_sizes=_TP_WORLDS,
        model_kinds=("transformer",),
        pins={**_TP, "loss_parallel": True},
    ),
    ZooBug(
        "dropout_seeded_per_rank",
        _mutant("dropout_seeded_per_rank"),
        "each rank's generator seeded by its global rank: the tp ranks draw different masks for a replicated activation",
        "issue 39: `seed + rank` where `seed + dp_rank` was meant",
        ("rng", "logits"),
        world_sizes=_TP_WORLDS,
        model_kinds=("transformer",),
        pins={**_TP, "sequence_parallel": False, "model.dropout": 0.1},
    ),
    ZooBug(
        "embedding_tokens_not_masked",
        _mutant("embedding_tokens_not_masked"),
        "a vocabulary-sharded embedding clamps tokens outside a rank's rows instead of masking them",
        "issue 39: a hand-written vocab-parallel embedding without its mask (`_MaskPartial`)",
        ("logits",),
        world_sizes=_TP_WORLDS,
        model_kinds=("transformer",),
        pins=dict(_TP),
    ),
    # A resume beside tp (docs/resume.md), its degree drawn among 1 and 2 on either side.
    ZooBug(
        "tp_shards_on_the_wrong_rank_on_resume",
        _mutant("tp_shards_on_the_wrong_rank_on_resume"),
        "one tensor-parallel parameter's tp shards loaded onto the wrong tp ranks (rank t holds rank t + 1's)",
        "issue 39: a loader that maps shards to ranks by position in the tp group, not by DCP's global offsets",
        ("resumed",),
        world_sizes=_TP_WORLDS,
        pins={**_RESUME, "tp": st.sampled_from((1, 2))},
    ),
    ZooBug(
        "rng_by_global_rank_on_resume",
        _mutant("rng_by_global_rank_on_resume"),
        "each rank takes back its own global rank's generator across a change of the tp degree",
        "issue 39: a resume written for data parallelism alone (rank r's stream is rank r's)",
        ("resumed",),
        world_sizes=_TP_WORLDS,
        model_kinds=("transformer",),
        pins={**_RESUME, "tp": st.sampled_from((1, 2)), "model.dropout": 0.1},
    ),
]

BY_NAME = {bug.name: bug for bug in ZOO}

# Expert parallelism and the grouped experts' routing (issue 40, docs/expert-parallel.md).
_GROUPED = {**_CHEAP, "model.experts": 4, "model.top_k": st.sampled_from((1, 2))}
ZOO += [
    ZooBug(
        "ep_tokens_combined_out_of_order",
        _mutant("ep_tokens_combined_out_of_order"),
        "the experts' outputs sent back in the ep rank's order (expert by expert), not the order the tokens came in",
        "a token combine that forgets the unpermute after the all-to-all (issue 40)",
        ("logits",),
        world_sizes=(2, 4),
        pins={**_GROUPED, "ep": 2},
    ),
    ZooBug(
        "ep_expert_grads_averaged_over_ep",
        _mutant("ep_expert_grads_averaged_over_ep"),
        "the experts' gradients averaged over the ep group as if the experts were replicated there",
        "a DDP-style all-reduce over every rank holding 'the experts' beside expert parallelism (issue 40)",
        ("grads",),
        world_sizes=(2, 4),
        pins={**_GROUPED, "ep": 2},
    ),
    ZooBug(
        "clip_norm_of_one_mesh",
        _mutant("clip_norm_of_one_mesh"),
        "every gradient clipped by the dense parameters' norm, the experts' (on their own mesh) left out",
        "a clip that keeps one mesh's parameters to get past DTensor's 'different meshes' error (issue 50)",
        ("grad_norm",),
        world_sizes=(2, 4),
        pins={**_GROUPED, "ep": 2, "clip_norm": 0.05},
    ),
    ZooBug(
        "aux_loss_per_rank",
        _mutant("aux_loss_per_rank"),
        "the load-balancing loss from each rank's own assignment counts, not the global micro-batch's",
        "a per-rank mean of the auxiliary loss where the recipe balances the global batch (issue 40)",
        ("grads", "comm"),  # the counts' all-reduce it leaves out, where the contract holds
        pins={**_GROUPED, "model.aux_loss": st.sampled_from((0.1, 0.5)), "grad_reduction": "avg"},
    ),
    ZooBug(
        "router_bias_updated_on_rank0_only",
        _mutant("router_bias_updated_on_rank0_only"),
        "only rank 0 moves the router bias after a step; the other ranks keep theirs",
        "aux-loss-free balancing updated under `if rank == 0` without a broadcast (issue 40)",
        ("buffers",),
        pins={**_GROUPED, "model.router_bias": st.sampled_from((0.01, 0.05)), "activation_checkpointing": False},
    ),
    ZooBug(
        "capacity_drops_differ_on_rank1",
        _mutant("capacity_drops_differ_on_rank1"),
        "rank 1 keeps each expert's highest-scoring assignments under capacity, the others their first",
        "capacity dropping decided by different rules on different ranks (issue 40)",
        ("logits", "grads"),
        pins={**_GROUPED, "model.capacity_factor": 0.5},
    ),
    ZooBug(
        "ep_experts_loaded_into_another_ep_rank",
        _mutant("ep_experts_loaded_into_another_ep_rank"),
        "after a resume each ep rank holds the experts (and their optimizer state) of the next ep rank",
        "local experts saved under their local index and read back on another ep layout (issue 40)",
        ("resumed",),
        world_sizes=(2, 4),
        pins={**_GROUPED, "resume": True, "ep": 2, "resume_ep": st.sampled_from((2, 4))},
    ),
]
BY_NAME = {bug.name: bug for bug in ZOO}

# Pipeline parallelism (issue 40, docs/pipeline-parallel.md).
_PIPELINE = {**_CHEAP, "pp": 2, "microbatches": _MICROBATCHES}
ZOO += [
    ZooBug(
        "pp_loss_not_divided_by_microbatches",
        _mutant("pp_loss_not_divided_by_microbatches"),
        "the schedule's gradients not divided by the micro-batches while each loss is scaled for their mean",
        "`scale_grads=False` beside a loss_fn that averages (torch.distributed.pipelining; issue 40)",
        ("grads",),
        pins=dict(_PIPELINE),
    ),
    ZooBug(
        "pp_clip_norm_of_own_stages",
        _mutant("pp_clip_norm_of_own_stages"),
        "each pp rank clips by its own stages' norm, never summed over the stages",
        "a clip written for FSDP alone, kept when the model was split into stages (torchtitan clips over the pp mesh; issue 50)",
        ("grad_norm",),
        pins={**_PIPELINE, "clip_norm": 0.05},
    ),
    ZooBug(
        "tp_plan_on_first_stage_only",
        _mutant("tp_plan_on_first_stage_only"),
        "under pp, the tp plan applied to the first stage only: the later stages' weights whole on every tp rank",
        "issue 50: torchtitan's 3-D parallelism, a parallelize call on `model_parts[0]` instead of each part",
        ("build",),
        world_sizes=(4,),
        model_kinds=("transformer",),
        pins={**_PIPELINE, "tp": 2},
    ),
    ZooBug(
        "pp_stage_boundary_detached",
        _mutant("pp_stage_boundary_detached"),
        "every stage after the first detaches its input: no gradient reaches the earlier stages",
        "an `x.detach()` at a stage boundary (issue 40)",
        ("grads",),
        pins=dict(_PIPELINE),
    ),
    ZooBug(
        "pp_tied_embedding_grads_not_summed",
        _mutant("pp_tied_embedding_grads_not_summed"),
        "the tied embedding's copies on the first and last stage each keep their own gradient",
        "weight tying across pipeline stages without the gradient all-reduce between them (issue 40)",
        ("grads",),
        model_kinds=("transformer",),
        pins={**_PIPELINE, "model.tie_embeddings": True},
    ),
    ZooBug(
        "pp_stage_reduces_every_microbatch",
        _mutant("pp_stage_reduces_every_microbatch"),
        "the first stage reduces on every micro-batch, each reduction divided by a factor meant for one",
        "a stage that ignores the schedule's no-sync, its divide factor set for the step's one reduction (issue 40)",
        ("grads",),
        # its own divide factor: under a sum reduction (drawn beside pp since issue 50) the knobs
        # check would name `grad_reduction` first
        pins={**_PIPELINE, "grad_reduction": "avg"},
    ),
    ZooBug(
        "pp_microbatches_reversed_on_last_stage",
        _mutant("pp_microbatches_reversed_on_last_stage"),
        "the last stage takes the targets' micro-batches in reverse order",
        "a stage's data loader out of step with the first stage's (issue 40)",
        ("grads",),
        pins=dict(_PIPELINE),
    ),
    ZooBug(
        "pp_stage_loads_another_stages_state",
        _mutant("pp_stage_loads_another_stages_state"),
        "after a resume the last stage's blocks hold the first stage's saved weights",
        "each stage's blocks saved under their index within the stage and loaded from another stage's (issue 40)",
        ("resumed",),
        model_kinds=("transformer",),  # every block of one shape: the other stage's loads without complaint
        pins={**_PIPELINE, "resume": True, "resume_pp": 2},
    ),
]
BY_NAME = {bug.name: bug for bug in ZOO}


# Bugs planted around torchtitan's own code (issue 49): its debug Llama cut to two blocks.
_TITAN = ("torchtitan", "llama3:debugmodel", (("n_layers", 2),))
ZOO += [
    ZooBug(
        "titan_division_left_on",
        "fsdp_verify.zoo.torchtitan:titan_division_left_on",
        "torchtitan's FSDP with FSDP2's gradient division back on while the loss is normalised by the global tokens",
        "global-token normalisation added to a loop that kept FSDP's average (torchtitan's own migration)",
        ("build",),  # the knobs check: `grad_reduction: sum` declared, the divide factor not 1.0
        world_sizes=(2,),
        precisions=("fp32",),
        pins=dict(_CHEAP),
        framework=_TITAN,
    ),
    ZooBug(
        "titan_norm_head_over_the_shard_dim",
        "fsdp_verify.zoo.torchtitan:titan_norm_head_over_the_shard_dim",
        "torchtitan's [norm, lm_head] unit sharded over the HSDP mesh's shard dim alone: never reduced over replicas",
        "a unit over several modules given a mesh of its own (torchtitan's separate [norm, lm_head] call)",
        ("grads",),
        world_sizes=(4,),
        precisions=("fp32",),
        pins={**_CHEAP, "mesh_shape": (2, 2)},
        framework=_TITAN,
    ),
    ZooBug(
        "titan_loss_normalised_per_rank",
        "fsdp_verify.zoo.torchtitan:titan_loss_normalised_per_rank",
        "torchtitan's FSDP with each rank's loss divided by its own valid tokens instead of the global count",
        "per-rank token normalisation in a data-parallel loop (torchtitan's loss before global-token scaling)",
        ("loss", "grads"),
        world_sizes=(2,),
        precisions=("fp32",),
        pins={**_CHEAP, "data.padded": True},
        framework=_TITAN,
    ),
    ZooBug(
        "titan_tokens_counted_per_tp_rank",
        "fsdp_verify.zoo.torchtitan:titan_tokens_counted_per_tp_rank",
        "torchtitan's tp with the global token count all-reduced over the world: each tp rank's batch counted once more",
        "a count of the step's tokens over the wrong mesh (the world, not the batch's data-parallel ranks)",
        ("loss", "grads"),
        world_sizes=(2,),
        precisions=("fp32",),
        pins={**_CHEAP, "tp": 2},
        framework=_TITAN,
    ),
    ZooBug(
        "titan_pp_schedule_scales_grads",
        "fsdp_verify.zoo.torchtitan:titan_pp_schedule_scales_grads",
        "torchtitan's pipeline with its schedule dividing by the micro-batches a loss already scaled to the step",
        "a schedule built with torch's default scale_grads=True beside torchtitan's global-token loss",
        ("grads",),
        world_sizes=(2,),
        precisions=("fp32",),
        pins={**_CHEAP, "pp": 2, "pp_schedule": "gpipe", "microbatches": 2},
        framework=_TITAN,
    ),
]
BY_NAME = {bug.name: bug for bug in ZOO}


# Bugs planted around Accelerate's own FSDP2 preparation (issue 49): the tiny Llama, every unit
# kept unsharded after forward as Accelerate keeps its [norm, head] (docs/frameworks/accelerate.md).
_ACCEL = ("accelerate", "fsdp_verify.models.hf:tiny_llama", ())
_ACCEL_PINS = {**_CHEAP, "reshard_after_forward": False}
ZOO += [
    ZooBug(
        "accel_rope_buffer_left_zero",
        "fsdp_verify.zoo.accelerate:accel_rope_buffer_left_zero",
        "Accelerate's FSDP2 with RoPE's inv_freq left at transformers' zero placeholder on the ranks other than 0",
        "cpu_ram_efficient_loading: the non-persistent buffers are not in the state dict Accelerate broadcasts"
        " (fsdp2_prepare_model keeps each rank's own), and a model's _init_weights that does not recompute them",
        ("buffers",),
        world_sizes=(2, 3),
        pins=dict(_ACCEL_PINS),
        framework=_ACCEL,
    ),
    ZooBug(
        "accel_full_state_dict_stale",
        "fsdp_verify.zoo.accelerate:accel_full_state_dict_stale",
        "Accelerate's fsdp2_load_full_state_dict broadcasting a stale copy of rank 0's weights",
        "a full state dict copied before the checkpoint (or initialisation) replaced the factory's weights",
        ("init",),
        world_sizes=(2, 3),
        precisions=("fp32",),
        pins=dict(_ACCEL_PINS),
        framework=_ACCEL,
    ),
    ZooBug(
        "accel_mixed_precision_dropped",
        "fsdp_verify.zoo.accelerate:accel_mixed_precision_dropped",
        "Accelerate's FSDP2 plugin reaching fsdp2_prepare_model without its mixed precision: fp32 throughout",
        "an FSDP2 plugin forced past Accelerate's device check without the branch's set_mixed_precision",
        ("precision", "logits", "loss"),
        world_sizes=(2, 3),
        precisions=("bf16",),
        pins=dict(_ACCEL_PINS),
        framework=_ACCEL,
    ),
]


# A bug planted around verl's own FSDP2 code (issue 49): the tiny Llama (docs/frameworks/verl.md).
ZOO += [
    ZooBug(
        "verl_clip_by_local_norm",
        "fsdp_verify.zoo.verl:verl_clip_by_local_norm",
        "verl's FSDP2 with each rank's gradients clipped by its local shards' norm, not the DTensor's",
        "a clip handed grad.to_local() (unwrapped before the norm): verl's fsdp2_clip_grad_norm_ reads the DTensors",
        ("grad_norm",),
        world_sizes=(2, 3),
        precisions=("fp32",),
        pins={**_CHEAP, "clip_norm": st.sampled_from((1e-3, 1e-2))},
        framework=("verl", "fsdp_verify.models.hf:tiny_llama", ()),
    ),
]
BY_NAME = {bug.name: bug for bug in ZOO}
