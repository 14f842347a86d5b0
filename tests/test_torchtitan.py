"""torchtitan's own FSDP2 code under test (verify/frameworks/torchtitan.py): its debug Llama from
its registry, its ParallelDims and `parallelize_llama` (so `apply_fsdp_to_decoder`: one unit over
`[norm, lm_head]`, gradient division off), its loss and its clip, unchanged, against the
one-device reference. The bugs planted around it are the zoo's (verify/zoo/torchtitan.py,
tests/test_zoo.py runs them)."""

from __future__ import annotations

import json

import pytest

from fsdp_verify.case import Case, CaseError
from fsdp_verify.frameworks import preset
from tests.in_process import run_cli

pytest.importorskip("torchtitan")

TWO_BLOCKS = {"n_layers": 2}


def titan_case(world: int, **changes) -> Case:
    fields = preset("torchtitan", "llama3:debugmodel", TWO_BLOCKS)
    batch = changes.pop("batch", 2 * world)
    return Case(world_size=world, steps=2).with_(**{**fields, "data.batch_size": batch, **changes})


def test_the_preset_is_torchtitans_units_engine_loss_and_reduction():
    case = titan_case(2)
    assert case.wrap_plan == ("tok_embeddings", "layers.0", "layers.1", "norm+lm_head", "")
    assert case.engine == "fsdp_verify.frameworks.torchtitan:parallelize" and case.grad_reduction == "sum"
    assert case.model.kwargs == {"flavor": "debugmodel", "seq_len": 16, "n_layers": 2}
    assert case.loss == "fsdp_verify.frameworks.torchtitan:loss" and not case.precision.cast_forward_inputs


def test_torchtitans_fsdp_is_equivalent_and_its_norm_head_unit_is_one_unit(fsdp_check):
    case = titan_case(2)
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()
    # the ownership check held every parameter to the plan's unit: lm_head's and norm's to the one
    # unit torchtitan built over both ('norm+lm_head'), as FSDP2's state names it
    checked = {f.comparator for f in verdict.findings if f.kind == "check"}
    assert {"OwnershipCheck", "CommContract", "MemoryContract"} <= checked, checked


def test_hsdp_with_torchtitans_clip_gives_the_references_norm(fsdp_check):
    """pytorch/torchtitan#2318 reports grad norms a factor apart between FSDP and HSDP: here the
    total norm torchtitan's `clip_grad_norm_` returns on a (2, 2) mesh is the reference's, bit for
    bit, with bf16 parameters and fp32 reduction (torchtitan 0.3.0, torch 2.13, gloo)."""
    case = titan_case(
        4, mesh_shape=(2, 2), clip_norm=1e-3, **{"precision.param_dtype": "bf16", "precision.reduce_dtype": "fp32"}
    )
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()
    norms = [f for f in verdict.findings if f.phase == "grad_norm"]
    assert norms and all(f.ok and f.max_abs == 0 for f in norms), norms


def test_one_command_runs_it():
    r = run_cli(
        [
            "check",
            "--framework",
            "torchtitan",
            "--model",
            "llama3:debugmodel",
            "--model-kwargs",
            '{"n_layers": 1}',
            "--steps",
            "1",
        ]
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "EQUIVALENT: fsdp_verify.frameworks.torchtitan:parallelize" in r.stdout


def test_a_model_torchtitan_does_not_have_is_bad_input():
    r = run_cli(["check", "--framework", "torchtitan", "--model", "gpt9:huge"])
    assert r.returncode == 2 and "model: expected MODEL:FLAVOR with --framework torchtitan" in r.stderr, r.stderr


def test_a_case_file_of_one_replica_replays_without_trust_as_equivalent(tmp_path):
    """A sweep's case file of torchtitan on a (1, 2) mesh: `repro` replays it without
    --trust-code (the toolkit's torchtitan factory takes a flavor and counts, never an import
    string), and it is equivalent: torchtitan builds one replica as plain FSDP over a 1-D mesh,
    with no all-reduce over the one-rank replica group FSDP2's 2-D mesh would issue, a call that
    moves nothing (the sweep of seed 4911 called 26 of 60 cases a divergence before it was optional)."""
    path = titan_case(2, steps=1, mesh_shape=(1, 2), microbatches=2).save(tmp_path / "one_replica.case.json")
    r = run_cli(["repro", str(path)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "EQUIVALENT" in r.stdout, r.stdout


# ---- torchtitan's own activation checkpointing ---------------------------------------------------
def _blocks_as_torchtitan_built_them(engine) -> list:
    """Each block of the model `engine` returns for a checkpointed case, on one rank (PyTorch's
    threaded process group): whether it is a `CheckpointWrapper`, and its checkpoint's
    `context_fn` (None: every op recomputed)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_verify.engines import ShardSpec
    from fsdp_verify.models import build_model
    from tests.ranks import on_threads

    case = titan_case(1, activation_checkpointing=True)

    def build(rank):
        model = engine(build_model(case.model, case.seed), init_device_mesh("cpu", (1,)), ShardSpec.from_case(case))
        blocks = list(model.layers.values())
        return [(isinstance(b, CheckpointWrapper), b.checkpoint_fn.keywords.get("context_fn")) for b in blocks]

    return on_threads(1, build)[0]


def test_torchtitans_own_checkpointing_is_applied_and_the_loops_is_not():
    """`--activation-checkpointing` under `--framework torchtitan` is torchtitan's policy, applied by
    its `parallelize_llama`: its default `SelectiveAC` (a per-op `context_fn`), or `FullAC` with
    `parallelize_full_ac`; the engine declares `checkpoints`, so the loop adds none of its own."""
    from fsdp_verify.engines import capabilities_of
    from fsdp_verify.frameworks.torchtitan import parallelize, parallelize_full_ac

    assert capabilities_of(parallelize).checkpoints and capabilities_of(parallelize_full_ac).checkpoints
    selective = _blocks_as_torchtitan_built_them(parallelize)
    assert [wrapped for wrapped, _ in selective] == [True, True], selective
    assert all(context is not None for _, context in selective), selective
    full = _blocks_as_torchtitan_built_them(parallelize_full_ac)
    assert [wrapped for wrapped, _ in full] == [True, True] and all(c is None for _, c in full), full


@pytest.mark.parametrize(
    "engine, world, changes",
    [
        ("parallelize", 2, {}),
        (
            "parallelize_full_ac",
            4,
            {
                "mesh_shape": (2, 2),
                "clip_norm": 1e-3,
                "precision.param_dtype": "bf16",
                "precision.reduce_dtype": "fp32",
            },
        ),
    ],
    ids=["selective-2", "full-hsdp-bf16-clip"],
)
def test_torchtitans_checkpointed_blocks_are_equivalent(fsdp_check, engine, world, changes):
    """Before the wrappers' `_checkpoint_wrapped_module.` segments were read through
    (verify/module_names.py), every parameter of a checkpointed block was "not a parameter of the
    reference model" (436 records)."""
    case = titan_case(world, activation_checkpointing=True)
    verdict = fsdp_check(case.with_(engine=f"fsdp_verify.frameworks.torchtitan:{engine}", **changes))
    assert verdict.ok, verdict.summary()
    checked = {f.comparator for f in verdict.findings if f.kind == "check"}
    assert {"OwnershipCheck", "CommContract"} <= checked, checked


@pytest.mark.parametrize("command", ["sweep", "fuzz"])
def test_an_engine_given_beside_the_framework_is_the_one_drawn(command):
    """As `check` applies flags on top of the framework's fields, so do the draws: the sweep of
    seed 5004 (`--engine ...:parallelize_full_ac`) ran torchtitan's default engine before."""
    from fsdp_verify.commands.cli import build_parser
    from fsdp_verify.commands.options import strategy_from_args

    flags = ["--framework", "torchtitan", "--model-kwargs", '{"n_layers": 1}']
    full = "fsdp_verify.frameworks.torchtitan:parallelize_full_ac"
    for given, drawn in (([], "fsdp_verify.frameworks.torchtitan:parallelize"), (["--engine", full], full)):
        args = build_parser().parse_args([command, "--out", "unused", *flags, *given])
        strategy_from_args(args, hsdp=False)
        assert args.engine == drawn, (given, args.engine)
    plain = build_parser().parse_args([command, "--out", "unused"])
    strategy_from_args(plain, hsdp=False)
    assert plain.engine == "fsdp2"


COMPILED = {"compile": "blocks", "compile_fullgraph": True, "compile_backend": "aot_eager"}


def test_torchtitans_compile_is_its_blocks_and_equivalent(fsdp_check):
    """torchtitan's `apply_compile` (each block of `model.layers`, fullgraph, automatic dynamic
    shapes, two Dynamo options set process-wide), after its activation checkpointing: the
    reference compiles the same blocks the same way (`compile: blocks`, the engine's declared
    `dynamic` and options), and every record agrees; the knobs check found both blocks compiled."""
    verdict = fsdp_check(titan_case(2, activation_checkpointing=True, microbatches=2, **COMPILED))
    assert verdict.ok, verdict.summary()
    checked = {f.comparator for f in verdict.findings if f.kind == "check"}
    assert {"KnobsApplied", "CompileReport"} <= checked, checked


def test_torchtitans_compile_config_left_off_is_named(fsdp_check):
    verdict = fsdp_check(titan_case(2, **COMPILED).with_(engine="tests/engines/torchtitan_compile.py:compile_left_off"))
    first = verdict.first_divergence
    assert not verdict.ok and (first.phase, first.name, first.comparator) == ("build", "<compile>", "KnobsApplied")
    assert "layers.0" in first.message, first.message


def test_torchtitan_takes_only_its_own_compile_and_is_drawn_only_that():
    """Its blocks, fullgraph: the toolkit's other scopes, or fullgraph off, are bad input naming the
    field, and the draws give it nothing else."""
    from fsdp_verify.engines import refuse_untakeable
    from fsdp_verify.properties.draw import draw_cases
    from fsdp_verify.properties.pins import PinError
    from fsdp_verify.properties.strategies import cases
    from fsdp_verify.validation import CaseError

    with pytest.raises(CaseError, match=r"compile: expected one of \('blocks',\)"):
        refuse_untakeable(titan_case(2, compile="model"))
    with pytest.raises(CaseError, match="compile_fullgraph: expected true"):
        refuse_untakeable(titan_case(2, compile="blocks", compile_backend="eager"))
    fields = preset("torchtitan", "llama3:debugmodel", TWO_BLOCKS)
    pins = {k: v for k, v in fields.items() if k != "engine"}
    drawn = draw_cases(cases(engine=fields["engine"], world_sizes=(2,), compile_rate=1.0, **pins), 6, 3)
    assert drawn and {(c.compile, c.compile_fullgraph) for c in drawn} == {("blocks", True)}, drawn
    with pytest.raises(PinError, match=r"compile: expected one of \('blocks',\)"):  # a pin it cannot take
        cases(engine=fields["engine"], compile="units", **pins)


# ---- torchtitan's own tensor parallelism ---------------------------------------------------------
def test_torchtitans_tp_is_bit_exact_with_its_checkpointing_and_clip(tmp_path):
    """dp 2 x tp 2 through torchtitan's own `model.parallelize(parallel_dims)` (its sharding
    declarations, sequence parallelism on as by default), its `SelectiveAC`, its clip over both
    meshes, its vocabulary-parallel cross-entropy: every record bit for bit. Before the
    reference kept torchtitan's activations DTensors between modules (`tp_plan`'s
    `local_outputs=False`), each norm's input gradient met its residual's in another order and
    the attention's gradients parted by an ulp (235x at step 1 after Adam); before the
    communication probe named a group by its ranks, torchtitan's "fsdp" dim was not the case's
    "shard" (the clip's all-reduce)."""
    r = run_cli(
        ["check", "--framework", "torchtitan", "--model-kwargs", '{"n_layers": 1}', "--tp", "2", "--world-size", "4"]
        + ["--steps", "1", "--activation-checkpointing", "--clip-norm", "1.0", "--json", str(tmp_path / "v.json")]
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["case"]["tp_plan"] == "fsdp_verify.frameworks.torchtitan:tp_plan" and report["case"]["loss_parallel"]
    numbers = [f for f in report["findings"] if f["kind"] == "deviation" and f["phase"] != "param_sums"]
    assert {f["phase"] for f in numbers} >= {"logits", "loss", "grads", "grad_norm", "params", "optim_state"}
    assert all(f["max_abs"] == 0 for f in numbers), [f for f in numbers if f["max_abs"]][:3]
    checked = {f["comparator"] for f in report["findings"] if f["kind"] == "check" and f["ok"]}
    assert {"KnobsApplied", "CommContract", "OwnershipCheck"} <= checked, checked


def test_torchtitans_tp_with_bf16_parameters_meets_the_known_pytorch_bug(fsdp_check):
    """torchtitan's default tp (sequence parallelism) with bf16 parameters and fp32 reduction is
    where FSDP2 sums a norm's tp-partial gradient in bf16 (pytorch/pytorch#190626): caught at the
    first norm's gradient, and the hint names it."""
    verdict = fsdp_check(titan_tp_case(2, steps=1, **{"precision.param_dtype": "bf16"}))
    first = verdict.first_divergence
    assert not verdict.ok and first.phase == "grads" and first.name.endswith("norm.weight"), verdict.summary()
    assert "pytorch/pytorch#190626" in verdict.hint, verdict.hint


TP = {"tp_plan": "fsdp_verify.frameworks.torchtitan:tp_plan", "loss_parallel": True}


def titan_tp_case(world: int, kwargs: dict | None = None, **changes) -> Case:
    fields = preset("torchtitan", "llama3:debugmodel", kwargs or {"n_layers": 1}, tp=True)
    return Case(world_size=world, steps=2).with_(**{**fields, "tp": 2, "data.batch_size": world, **changes})


def test_torchtitans_tp_without_sequence_parallelism_is_refused_and_bf16_is_not_drawn():
    from fsdp_verify.frameworks.torchtitan import TP_FIELDS
    from fsdp_verify.properties.draw import draw_cases
    from fsdp_verify.properties.strategies import cases
    from fsdp_verify.validation import CaseError

    assert TP == TP_FIELDS and preset("torchtitan", None, TWO_BLOCKS, tp=True).items() >= TP.items()
    with pytest.raises(CaseError, match="model.kwargs: expected sequence_parallel true under tp"):
        titan_tp_case(2, {"n_layers": 1, "sequence_parallel": False})
    with pytest.raises(CaseError, match="model.seq_len: expected a multiple of tp=2 .sequence parallelism"):
        titan_tp_case(2).with_(**{"model.seq_len": 15})  # a plan with SequenceParallel modules splits it
    fields = preset("torchtitan", "llama3:debugmodel", {"n_layers": 1}, tp=True)
    pins = {k: v for k, v in fields.items() if k != "engine"}
    drawn = draw_cases(
        cases(engine=fields["engine"], world_sizes=(2, 4), precisions=("fp32", "bf16"), tp=2, **pins), 8, 7
    )
    assert drawn and all(c.tp == 2 and c.tp_plan == TP["tp_plan"] for c in drawn), drawn
    assert {c.precision.param_dtype for c in drawn} == {None}  # bf16 would draw #190626 every time
    assert all(c.model.seq_len % 2 == 0 for c in drawn)  # the sequence splits over the tp ranks


# ---- its pipeline (issue 49): `pipeline_llm`, its split, its schedule --------------------------------------
def test_torchtitans_pipeline_is_bit_exact_with_its_clip_over_the_stages(tmp_path):
    """pp 2 x dp 2 through torchtitan's own `pipeline_llm`: its split (a copy of the model a stage,
    the others' modules deleted), `parallelize_llama` on each part (its FSDP with `[norm, lm_head]`
    in the last stage), its Interleaved1F1B schedule with `scale_grads=False` (each micro-batch's
    loss its share of the step's; four stages of a two-block model, the first the embedding
    alone, the last norm and head alone, two parts a rank gathered under the model's names for
    the records), its clip over the pp mesh; bf16 parameters, its `SelectiveAC`: every
    record bit for bit. The reference learns the split from `pp_split` (torchtitan's own module
    names per stage) and the schedule's scaling from `pp_scale_grads`."""
    r = run_cli(
        ["check", "--framework", "torchtitan", "--model-kwargs", '{"n_layers": 2}', "--pp", "2", "--world-size", "4"]
        + ["--pp-schedule", "interleaved1f1b", "--microbatches", "2", "--steps", "2", "--param-dtype", "bf16"]
        + ["--activation-checkpointing", "--clip-norm", "0.05", "--json", str(tmp_path / "v.json")]
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "v.json").read_text())
    case = report["case"]
    assert (case["pp_split"], case["pp_scale_grads"], case["sync_every_microbatch"]) == (
        "fsdp_verify.frameworks.torchtitan:pp_split",
        False,
        False,
    )
    numbers = [f for f in report["findings"] if f["kind"] == "deviation" and f["phase"] != "param_sums"]
    assert {f["phase"] for f in numbers} >= {"logits", "loss", "grads", "grad_norm", "params", "optim_state"}
    assert all(f["max_abs"] == 0 for f in numbers), [f for f in numbers if f["max_abs"]][:3]
    # every rank holds only its stage's modules: the buffers of the other stage come from its ranks
    buffers = {f["name"] for f in report["findings"] if f["phase"] == "buffers" and f["kind"] == "deviation"}
    assert {"layers.0.attention.rope.cache", "layers.1.attention.rope.cache"} <= buffers, buffers


def test_torchtitans_split_is_its_module_names_per_stage_as_views_of_the_model():
    from fsdp_verify.frameworks.torchtitan import llama3, pp_split

    model = llama3(n_layers=3, seq_len=4)
    first, last = pp_split(model, 2)  # torchtitan: the embedding and the head each weigh one block
    assert list(first.layers) == ["0", "1"] and first.norm is None and first.lm_head is None
    assert list(last.layers) == ["2"] and last.tok_embeddings is None and last.lm_head is model.lm_head
    assert list(model.layers) == ["0", "1", "2"] and model.norm is not None  # the model is untouched
    shared = {id(p) for p in model.parameters()}
    assert all(id(p) in shared for stage in (first, last) for p in stage.parameters())


def test_what_torchtitans_pipeline_does_not_build_is_refused_naming_the_field():
    r = run_cli(
        ["check", "--framework", "torchtitan", "--pp", "2", "--world-size", "2", "--microbatches", "2"]
        + ["--pp-scale-grads", "true"]
    )
    assert r.returncode == 2 and "bad case: pp_scale_grads: expected false" in r.stderr, r.stderr


def test_torchtitans_3d_pipeline_and_tp_is_bit_exact(fsdp_check):
    """torchtitan's pp x tp (its 3-D without the data-parallel dim): `pipeline_llm` splits, then
    `parallelize_llama` applies its tp declarations and FSDP to each part; the last stage's loss
    is its vocabulary-parallel cross-entropy inside the schedule. Every record bit for bit."""
    fields = preset("torchtitan", "llama3:debugmodel", {"n_layers": 2}, tp=True, pp=True)
    case = Case(world_size=4, steps=1).with_(
        **{**fields, "tp": 2, "pp": 2, "pp_schedule": "gpipe", "microbatches": 2, "data.batch_size": 2}
    )
    verdict = fsdp_check(case.with_(clip_norm=0.05))
    assert verdict.ok, verdict.summary()
    numbers = [f for f in verdict.findings if f.kind == "deviation" and f.phase in ("loss", "grads", "params")]
    assert {f.phase for f in numbers} == {"loss", "grads", "params"} and all(f.max_abs == 0 for f in numbers)


def test_its_dimensions_are_drawn_together_and_apart():
    """`sweep --framework torchtitan --tp 1 2 --pp 1 2`: its tp and pipeline fields pinned, every
    combination drawn (a degree of 1 among those asked draws that dimension off, its fields with it)."""
    from collections import Counter

    from fsdp_verify.commands.options import framework_draw_pins
    from fsdp_verify.properties.draw import draw_cases
    from fsdp_verify.properties.strategies import cases
    from fsdp_verify.runner import refuse_untakeable

    fields = preset("torchtitan", None, TWO_BLOCKS, tp=True, pp=True)
    engine = fields.pop("engine")
    pins = framework_draw_pins(fields)
    strategy = cases(
        engine=engine, world_sizes=(2, 4, 8), precisions=("fp32",), hsdp=True, tp=[1, 2], pp=[1, 2], **pins
    )
    drawn = draw_cases(strategy, 40, 7)
    assert set(Counter((c.tp, c.pp) for c in drawn)) == {(1, 1), (1, 2), (2, 1), (2, 2)}
    for case in drawn:
        assert (case.pp_split is not None) == (case.pp > 1) and case.loss_parallel == (case.tp > 1)
        refuse_untakeable(case)


def titan_moe_case(world: int, model: str = "qwen3:debugmodel_moe", **changes) -> Case:
    """torchtitan's Qwen3 MoE debug model, one block of its experts (shrunk: 8 of them, 2 a token);
    or its DeepSeek-V3 debug model's dense block and first MoE block (8 experts, 3 a token, and
    shared experts)."""
    fields = preset("torchtitan", model, {"n_layers": 2 if model.startswith("deepseek") else 1})
    batch = changes.pop("batch", 2 * world)
    return Case(world_size=world, steps=2).with_(**{**fields, "data.batch_size": batch, **changes})


def test_torchtitans_moe_is_drawn_its_own_experts_and_its_block_units():
    case = titan_moe_case(4, ep=2)
    assert case.wrap_plan == ("tok_embeddings", "layers.0", "norm+lm_head", "")  # its experts inside the block
    from fsdp_verify.engines.expert_parallel import experts_of

    assert experts_of(case.model) == {"layers.0.moe.routed_experts.inner_experts": 8}
    with pytest.raises(CaseError, match=r"ep: expected a divisor of the experts \(8\)"):
        titan_moe_case(2, world_size=6, batch=12, ep=3)
    # fewer experts than the ranks it shards them over: torchtitan puts them on dim 1 (not modelled),
    # refused before any rank starts (exit 2), naming the field
    from fsdp_verify.engines import refuse_untakeable

    fields = preset("torchtitan", "qwen3:debugmodel_moe", {"n_layers": 1, "experts": 2})
    few = Case(world_size=4, steps=1).with_(**{**fields, "data.batch_size": 4})
    with pytest.raises(CaseError, match=r"model.kwargs.experts: expected at least the 4 ranks"):
        refuse_untakeable(few)
    refuse_untakeable(few.with_(world_size=2, **{"data.batch_size": 2}))


@pytest.mark.parametrize(
    ("world", "changes"),
    [
        (4, {"ep": 2, "clip_norm": 1e-3, "batch": 4}),  # two ep groups, each expert reduced over efsdp 2
        (4, {"ep": 2, "mesh_shape": (2, 2), "precision.param_dtype": "bf16", "activation_checkpointing": True}),
        (2, {"ep": 2, "model": "deepseek_v3:debugmodel", "clip_norm": 1e-3, "steps": 1}),
    ],
    ids=["ep2-of-4-clip", "ep2-hsdp-bf16-checkpointed", "deepseek-v3-ep2"],
)
def test_torchtitans_moe_under_its_expert_parallelism_is_bit_exact(fsdp_check, world, changes):
    """Its all-to-all dispatch, its grouped GEMM's weight gradients summed over the ep group's
    rows at once (reference/grouped_gemm.py), its per-parameter meshes in each block, its clip
    over the two meshes and its load balancing: every record exact, the bias moved."""
    from fsdp_verify.runner import emulating_reference

    case = titan_moe_case(world, **changes)
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()
    numeric = [f for f in verdict.findings if f.phase in ("grads", "params", "logits", "grad_norm", "buffers")]
    assert numeric and all(f.max_abs == 0 for f in numeric), [f for f in numeric if f.max_abs]
    records = emulating_reference(case).records
    biases = [t for (step, phase, name), t in records.items() if step == case.steps and "expert_bias" in name]
    assert biases and all(b.abs().max() > 0 for b in biases)  # torchtitan's own hook moved them, on both sides


def test_the_holders_gradient_is_one_product_over_the_ep_groups_rows(fsdp_check):
    """Without the grouped GEMM's emulation (each rank's own product, added: what the one-rank
    passes give), the experts' gradients part from torchtitan's at step 1: the emulation is what
    makes them exact, not a tolerance."""
    from unittest import mock

    from fsdp_verify.reference import grouped_gemm

    case = titan_moe_case(2, ep=2)
    with mock.patch.object(grouped_gemm.HolderGrads, "install", classmethod(lambda cls, case, model: None)):
        verdict = fsdp_check(case, calibrate=False)  # the first divergence is all it asks
    assert not verdict.ok
    first = verdict.first_divergence
    assert first.phase == "grads" and "inner_experts" in first.name, first
