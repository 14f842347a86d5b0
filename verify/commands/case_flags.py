"""Every Case field as a command-line flag, in one table (`FLAGS`): `check` (and every command that
builds one case) takes each as an override of `--case FILE`, `fuzz`/`sweep` take most as draw
options (one value pins the field, several are drawn among), the case strategies and the pytest
plugin take them as keywords (`fsdp_cases(optimizer=["adam", "sgd"], sync_last=True)`), and
`case_to_flags(case)` prints a case as the flags that rebuild it, hash for hash. A Case field
without a flag here fails tests/test_case_flags.py. Free of torch: pytest parses its options
with it."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsdp_verify.case import Case

from fsdp_verify.commands.flag import (  # noqa: F401 (the parsers, re-exported for the commands)
    _MISSING,
    _NONE,
    Flag,
    _fail,
    _items,
    _same,
    _tuple_of,
    boolean,
    dtype,
    integer,
    integers,
    mesh,
    names,
    number,
    numbers,
    or_none,
    reshard,
    text,
)

DTYPE = "fp32 | bf16 | fp16 (float32 ... accepted) | none"
IMPORT = "pkg.module:NAME or path/to/file.py:NAME"
MODEL = "model (built-in sizes, or your factory)"
MESH = "world and mesh"
PREC = "precision (FSDP2 MixedPrecisionPolicy)"
OPTIM = "optimizer"
LOOP = "training loop"
DATA = "data"
SCALE = "fp16 dynamic loss scaling"
CODE = "engine and your code"
TP = "tensor parallelism (docs/tensor-parallel.md)"
RESUME = "checkpoint and resume (docs/resume.md)"
EP = "expert parallelism (docs/expert-parallel.md)"
PP = "pipeline parallelism (docs/pipeline-parallel.md)"
COMPILE = "torch.compile (docs/compile.md)"

FLAGS: tuple[Flag, ...] = (
    # model
    Flag(
        "--model",
        "model.kind",
        MODEL,
        f"mlp | transformer | {IMPORT} (a factory NAME(**kwargs) -> nn.Module)",
        metavar="MODEL",
        draw="fixed",
        special=True,
        covers=("model.factory",),
    ),
    Flag(
        "--model-kwargs",
        "model.kwargs",
        MODEL,
        "keyword arguments of a model factory, a JSON object",
        metavar="JSON",
        draw="fixed",
        special=True,
    ),
    Flag(
        "--init-fn",
        "model.init_fn",
        MODEL,
        "init_fn(model, generator) run after the factory",
        or_none(str),
        "IMPORT",
        draw="fixed",
    ),
    Flag(
        "--output-fn",
        "model.output_fn",
        MODEL,
        "output_fn(output) -> logits, for a model's forward output",
        or_none(str),
        "IMPORT",
        draw="fixed",
    ),
    Flag(
        "--shrinkable",
        "model.shrinkable",
        MODEL,
        "integer model kwargs the shrinker may lower, comma-separated",
        names,
        "NAMES",
        draw="fixed",
    ),
    Flag("--widths", "model.widths", MODEL, "MLP widths input,hidden...,output (e.g. 16,33,8)", integers, "W,W,..."),
    Flag("--vocab-size", "model.vocab_size", MODEL, "Transformer vocabulary", int, "N"),
    Flag("--dim", "model.dim", MODEL, "Transformer model dimension (n_heads x an even head dimension)", int, "N"),
    Flag("--n-layers", "model.n_layers", MODEL, "Transformer blocks", int, "N"),
    Flag("--n-heads", "model.n_heads", MODEL, "Transformer attention heads", int, "N"),
    Flag("--ffn-hidden", "model.ffn_hidden", MODEL, "Transformer feed-forward width", int, "N"),
    Flag("--seq-len", "model.seq_len", MODEL, "length of the generated token sequences", int, "N"),
    Flag(
        "--tie-embeddings",
        "model.tie_embeddings",
        MODEL,
        "Transformer: output layer shares the embedding",
        boolean,
        "BOOL",
        const=True,
    ),
    Flag("--dropout", "model.dropout", MODEL, "dropout probability", number, "P"),
    Flag(
        "--experts",
        "model.experts",
        MODEL,
        "MLP: routed experts after the first block, top-1 per sample; 0 = none",
        int,
        "N",
    ),
    Flag(
        "--top-k",
        "model.top_k",
        MODEL,
        "MLP experts grouped as expert parallelism shards them (one weight of all experts), each sample sent to its"
        " K best; none = the per-expert loop (top-1)",
        or_none(integer),
        "K",
    ),
    Flag(
        "--capacity-factor",
        "model.capacity_factor",
        MODEL,
        "grouped experts: at most ceil(F x tokens x K / experts) assignments an expert takes on a rank, the rest"
        " dropped; none = dropless",
        or_none(number),
        "F",
    ),
    Flag(
        "--aux-loss",
        "model.aux_loss",
        MODEL,
        "grouped experts: the load-balancing loss's coefficient, over the global micro-batch; 0 = none",
        number,
        "C",
    ),
    Flag(
        "--router-bias",
        "model.router_bias",
        MODEL,
        "grouped experts: aux-loss-free balancing, the router bias's step per optimizer step (DeepSeek-V3); 0 = none",
        number,
        "R",
    ),
    Flag(
        "--frozen",
        "model.frozen",
        MODEL,
        "parameter-name prefixes with requires_grad=False, comma-separated, or none",
        names,
        "NAMES",
    ),
    # world, mesh, wrap
    Flag(
        "--world-size",
        "world_size",
        MESH,
        "ranks (default 2; --world-sizes in fuzz/sweep)",
        int,
        "N",
        draw=None,
        special=True,
    ),
    Flag(
        "--mesh-shape",
        "mesh_shape",
        MESH,
        "SHARD or REPLICATE,SHARD (HSDP); sets the world size to their product (times --tp and --pp); none = 1-D",
        mesh,
        "R,S",
        special=True,
    ),
    Flag(
        "--wrap",
        "wrap",
        MESH,
        "the wrap plan: module FQNs and/or class names (LlamaDecoderLayer = every such module); children"
        " first, the root added last; `default` = the model's plan",
        metavar="ENTRY",
        draw=None,
        special=True,
    ),
    Flag(
        "--reshard-after-forward",
        "reshard_after_forward",
        MESH,
        "true | false | K (reshard to groups of K ranks after forward)",
        reshard,
        "true|false|K",
    ),
    # precision
    Flag(
        "--param-dtype",
        "precision.param_dtype",
        PREC,
        DTYPE + " (--precisions in fuzz/sweep)",
        or_none(dtype),
        "DTYPE",
        draw=None,
    ),
    Flag("--reduce-dtype", "precision.reduce_dtype", PREC, DTYPE, or_none(dtype), "DTYPE"),
    Flag("--output-dtype", "precision.output_dtype", PREC, DTYPE, or_none(dtype), "DTYPE"),
    Flag(
        "--cast-forward-inputs",
        "precision.cast_forward_inputs",
        PREC,
        "cast forward inputs to param_dtype (default true)",
        boolean,
        "BOOL",
    ),
    # optimizer
    Flag("--optimizer", "optim.name", OPTIM, "sgd | adam | adamw | adagrad | rmsprop (default adamw)", str, "NAME"),
    Flag("--lr", "optim.lr", OPTIM, "learning rate (default 0.01)", number, "LR"),
    Flag("--momentum", "optim.momentum", OPTIM, "SGD momentum (default 0.9)", number, "M"),
    Flag("--weight-decay", "optim.weight_decay", OPTIM, "SGD and AdamW weight decay (default 0.01)", number, "WD"),
    Flag("--betas", "optim.betas", OPTIM, "Adam(W) betas B1,B2 (default 0.9,0.999)", numbers, "B1,B2"),
    Flag("--eps", "optim.eps", OPTIM, "Adam(W), Adagrad and RMSprop eps (default 1e-8)", number, "EPS"),
    # ---- optimizers, schedules, what is trained (docs/optimizers-and-schedules.md) ----
    Flag(
        "--amsgrad",
        "optim.amsgrad",
        OPTIM,
        "Adam(W) with amsgrad (the running max of the second moment kept as state)",
        boolean,
        "BOOL",
        const=True,
    ),
    Flag(
        "--lr-schedule",
        "optim.schedule",
        OPTIM,
        "exponential | linear_warmup | none: the learning rate changes every step (torch.optim.lr_scheduler)",
        or_none(str),
        "NAME",
    ),
    Flag(
        "--schedule-factor",
        "optim.schedule_factor",
        OPTIM,
        "exponential: gamma; linear_warmup: the first step's fraction of the rate (default 0.5)",
        number,
        "F",
    ),
    Flag(
        "--unfreeze-step",
        "unfreeze_step",
        LOOP,
        "the step from which the --frozen parameters train (frozen before it); none = frozen throughout",
        or_none(int),
        "N",
    ),
    Flag(
        "--clip-norm",
        "clip_norm",
        OPTIM,
        "clip the gradient norm to this max norm; none = no clipping",
        or_none(number),
        "NORM",
    ),
    # training loop
    Flag("--steps", "steps", LOOP, "optimizer steps (default 3)", int, "N"),
    Flag("--microbatches", "microbatches", LOOP, "micro-batches per step (gradient accumulation)", int, "N"),
    Flag(
        "--sync-last",
        "sync_every_microbatch",
        LOOP,
        "reduce gradients on the last micro-batch only (no_sync before it); `--sync-last false` = every one",
        boolean,
        "BOOL",
        const=True,
        invert=True,
    ),
    Flag("--init", "init", LOOP, "eager | meta (build on the meta device, then materialise)", str, "MODE"),
    Flag("--seed", "seed", LOOP, "the case's seed (initial values and dropout masks)", int, "N", draw=None),
    # fully_shard's knobs (issue 28, items 1-4)
    Flag(
        "--offload",
        "offload",
        LOOP,
        "FSDP2 offload_policy=CPUOffloadPolicy(pin_memory=False): sharded state and the optimizer step on the CPU",
        boolean,
        "BOOL",
        const=True,
    ),
    Flag(
        "--shard-placement",
        "shard_placement",
        LOOP,
        "FSDP2 shard_placement_fn: dim0 (Shard(0), default) | dim1 (Shard(1) where the shard group divides dim 1)"
        " | mixed (some Shard(1), some Shard(0))",
        str,
        "RULE",
    ),
    Flag(
        "--replica-sync-last",
        "replica_sync_last",
        LOOP,
        "HSDP: set_requires_all_reduce(False) before every micro-batch but the last (replicas all-reduce once)",
        boolean,
        "BOOL",
        const=True,
    ),
    Flag(
        "--reshard-after-backward-last",
        "reshard_after_backward_last",
        LOOP,
        "FSDP2 set_reshard_after_backward(False) before every micro-batch but the last (parameters kept"
        " unsharded between micro-batches: no forward all-gather after the first)",
        boolean,
        "BOOL",
        const=True,
    ),
    Flag(
        "--ignored",
        "ignored",
        LOOP,
        "FSDP2 ignored_params: parameter-name prefixes left unsharded and unreduced, their gradients all-reduced"
        " by the loop; comma-separated, or none",
        names,
        "NAMES",
    ),
    Flag(
        "--grad-reduction",
        "grad_reduction",
        LOOP,
        "avg (FSDP2's ReduceOp.AVG, default) | sum (set_gradient_divide_factor(1.0) on every unit, each rank's"
        " loss divided by the data-parallel world size)",
        str,
        "OP",
    ),
    Flag(
        "--prefetch",
        "prefetch",
        LOOP,
        "FSDP2 explicit prefetching: each unit's set_modules_to_forward_prefetch / set_modules_to_backward_prefetch"
        " lists the next K units of that pass; none = FSDP2's implicit prefetching only (default)",
        or_none(int),
        "K",
    ),
    Flag(
        "--activation-checkpointing",
        "activation_checkpointing",
        LOOP,
        "checkpoint every wrapped unit but the root (recomputation must replay dropout masks)",
        boolean,
        "BOOL",
        const=True,
    ),
    Flag(
        "--zoom-at",
        "zoom",
        LOOP,
        "record per-module probes at STEP, or the ops inside one module as STEP/forward/FQN or STEP/backward/FQN"
        " (what `zoom` and `check --zoom` set; docs/zoom.md)",
        or_none(str),
        "SPEC",
    ),
    # data
    Flag(
        "--batch-size",
        "data.batch_size",
        DATA,
        "global batch (default: rounded up to fit the world size)",
        int,
        "N",
        special=True,
    ),
    Flag(
        "--data-kind",
        "data.kind",
        DATA,
        "normal | cancellation (large per-rank gradients that nearly cancel; MLP)",
        str,
        "KIND",
    ),
    Flag("--data-scale", "data.scale", DATA, "scale of the generated inputs (default 1)", number, "S"),
    Flag(
        "--padded",
        "data.padded",
        DATA,
        "variable-length sequences padded with ignore_index (token models)",
        boolean,
        "BOOL",
        const=True,
    ),
    Flag("--data-seed", "data_seed", DATA, "the seed of the generated batches", int, "N"),
    Flag(
        "--data",
        "data.fn",
        DATA,
        "a data function, fn(case, step, generator) -> (inputs, targets); none = generated",
        or_none(str),
        "IMPORT",
    ),
    # loss scaling
    Flag(
        "--loss-scaling",
        "loss_scaling",
        SCALE,
        "fp16 dynamic loss scaling on both sides (torch.amp.GradScaler / ShardedGradScaler on the sharded one,"
        " written out in the reference): optionally KEY=VALUE pairs joined by commas, keys init_scale (65536),"
        " growth_factor (2), backoff_factor (0.5), growth_interval (2000), the rest default; 'off' removes a"
        " case file's",
        metavar="KEY=VALUE,...",
        const="",
        draw=None,
        special=True,
    ),
    Flag(
        "--init-scale",
        "loss_scaling.init_scale",
        SCALE,
        "the first loss scale (default 65536); turns loss scaling on",
        number,
        "S",
        special=True,
    ),
    Flag(
        "--growth-factor",
        "loss_scaling.growth_factor",
        SCALE,
        "scale growth after good steps (default 2); turns loss scaling on",
        number,
        "F",
        special=True,
    ),
    Flag(
        "--backoff-factor",
        "loss_scaling.backoff_factor",
        SCALE,
        "scale factor on inf/NaN (default 0.5); turns loss scaling on",
        number,
        "F",
        special=True,
    ),
    Flag(
        "--growth-interval",
        "loss_scaling.growth_interval",
        SCALE,
        "good steps before the scale grows (default 2000); turns loss scaling on",
        int,
        "N",
        special=True,
    ),
    # engine and user code
    Flag(
        "--engine",
        "engine",
        CODE,
        "fsdp2 | fsdp1 | flat | pkg.module:NAME | path/to/file.py:NAME",
        metavar="ENGINE",
        draw=None,
    ),
    Flag(
        "--ep",
        "ep",
        EP,
        "the expert-parallel degree: the grouped experts (--top-k) sharded over an ep dim carved out of the shard"
        " dim, tokens moved by all-to-all; 1 = none (default)",
        integer,
        "N",
    ),
    Flag(
        "--pp",
        "pp",
        PP,
        "the pipeline degree: the model cut into stages over a pp dim of N ranks, --world-size counting every rank"
        " (pp x data-parallel) and --mesh-shape the data-parallel part; 1 = none (default)",
        integer,
        "N",
    ),
    Flag(
        "--pp-schedule",
        "pp_schedule",
        PP,
        "gpipe | 1f1b | interleaved1f1b (two stages a rank); torch.distributed.pipelining's (default 1f1b)",
        str,
        "NAME",
    ),
    Flag(
        "--pp-split",
        "pp_split",
        PP,
        "your split: fn(model, n_stages) -> the stage modules (sharing the model's parameters); none = the built-in"
        " model's blocks split evenly",
        or_none(str),
        "IMPORT",
    ),
    Flag(
        "--pp-scale-grads",
        "pp_scale_grads",
        PP,
        "the schedule divides the gradients by the micro-batches (torch's default: true); false: each micro-batch's"
        " loss is its share of the step's, as torchtitan's schedule has it",
        boolean,
        "BOOL",
    ),
    # tensor parallelism (docs/tensor-parallel.md)
    Flag(
        "--tp",
        "tp",
        TP,
        "the tensor-parallel degree: the ranks form the mesh (dp, tp) or (replicate, shard, tp), --world-size counting"
        " every rank (dp x tp) and --mesh-shape the data-parallel part; 1 = none (default)",
        integer,
        "N",
    ),
    Flag(
        "--tp-plan",
        "tp_plan",
        TP,
        "your plan: a dict of module FQN to ParallelStyle, or a function (model, tp_mesh) returning one; none = the"
        " built-in model's, or a transformers model's own base_model_tp_plan",
        or_none(str),
        "IMPORT",
    ),
    Flag(
        "--sequence-parallel",
        "sequence_parallel",
        TP,
        "the built-in Transformer's plan with sequence parallelism (SequenceParallel norms)",
        boolean,
        "BOOL",
        const=True,
    ),
    Flag(
        "--loss-parallel",
        "loss_parallel",
        TP,
        "the head's output sharded over the vocabulary, the cross-entropy under loss_parallel()",
        boolean,
        "BOOL",
        const=True,
    ),
    # checkpoint and resume: drawn together by fuzz/sweep --resume (their values depend on the
    # steps, world size and engine drawn), so no draw option of their own
    Flag(
        "--resume-after",
        "resume_after",
        RESUME,
        "save a checkpoint after step K and resume from it (torch.distributed.checkpoint); none = no resume",
        or_none(integer),
        "K",
        draw=None,
    ),
    Flag(
        "--resume-world-size",
        "resume_world_size",
        RESUME,
        "ranks the run resumes on (default: as before)",
        or_none(integer),
        "N",
        draw=None,
    ),
    Flag(
        "--resume-mesh-shape",
        "resume_mesh_shape",
        RESUME,
        "SHARD or REPLICATE,SHARD the run resumes on (default: 1-D, or as before)",
        mesh,
        "R,S",
        draw=None,
    ),
    Flag(
        "--resume-engine",
        "resume_engine",
        RESUME,
        "the engine the run resumes with (e.g. fsdp2 after fsdp1; default: as before)",
        or_none(str),
        "ENGINE",
        draw=None,
    ),
    Flag(
        "--resume-tp",
        "resume_tp",
        RESUME,
        "the tp degree the run resumes with (--resume-world-size still counts every rank; default: as before)",
        or_none(integer),
        "N",
        draw=None,
    ),
    Flag(
        "--resume-ep",
        "resume_ep",
        RESUME,
        "the expert-parallel degree the run resumes with (DCP reshards the experts; default: as before)",
        or_none(integer),
        "N",
        draw=None,
    ),
    Flag(
        "--resume-pp",
        "resume_pp",
        RESUME,
        "the pipeline degree the run resumes with (default: as before)",
        or_none(integer),
        "N",
        draw=None,
    ),
    Flag(
        "--compile",
        "compile",
        COMPILE,
        "units (each unit of the wrap plan but the root, in place, before fully_shard) | blocks (each unit"
        " that is an element of a module list or dict: torchtitan's per-block compile) | model (the whole"
        " model) | none; the reference is compiled alike and checked against eager",
        or_none(str),
        "SCOPE",
    ),
    Flag(
        "--compile-fullgraph",
        "compile_fullgraph",
        COMPILE,
        "torch.compile(fullgraph=True): a graph break is an error",
        boolean,
        "BOOL",
        const=True,
    ),
    Flag(
        "--compile-backend",
        "compile_backend",
        COMPILE,
        "inductor (default) | aot_eager (Dynamo and AOTAutograd, no code generation) | eager (Dynamo alone)",
        str,
        "NAME",
    ),
    Flag(
        "--loss",
        "loss",
        CODE,
        "a loss, loss(logits, targets) -> sum over items; none = cross-entropy",
        or_none(str),
        "IMPORT",
    ),
    Flag(
        "--step",
        "step",
        CODE,
        "your training step NAME(model, optimizer, batch, ctx) -> loss, run unchanged on the reference and on every rank",
        or_none(str),
        "IMPORT",
    ),
)


def _packages_flags() -> tuple[Flag, ...]:
    """The registered dimension packages' rows (verify/dims/registry.py), after the table's own."""
    from fsdp_verify.dims.registry import packages

    return tuple(f for package in packages() for f in package.flags)


FLAGS = FLAGS + _packages_flags()
BY_FLAG = {f.flag: f for f in FLAGS}
BY_DEST = {f.dest: f for f in FLAGS}
GROUPS = tuple(dict.fromkeys(f.group for f in FLAGS))


def flag_of(field: str) -> str | None:
    """The flag that sets Case field `field` (dotted for nested specs), or None."""
    for f in FLAGS:
        if field == f.field or field in f.covers:
            return f.flag
    return None


def _engine_type(text: str) -> str:
    from fsdp_verify.engines import canonical_engine  # on use: the engines import torch

    return canonical_engine(text)


def _argparse_type(f: Flag) -> Callable[[str], Any]:
    return _engine_type if f.flag == "--engine" else f.parse


# ---- check: one value per flag ------------------------------------------------------------------
def add_flags(p: argparse.ArgumentParser, groups: dict[str, Any] | None = None) -> None:
    """Every flag of the table, by argument group, each defaulting to None (not given)."""
    groups = groups if groups is not None else {}
    for f in FLAGS:
        group = groups.get(f.group) or groups.setdefault(f.group, p.add_argument_group(f.group))
        kwargs: dict[str, Any] = {"dest": f.dest, "metavar": f.metavar, "help": f.help, "default": None}
        if f.flag == "--wrap":
            kwargs["nargs"] = "+"
        else:
            kwargs["type"] = _argparse_type(f)
        if f.const is not _MISSING:
            kwargs.update(nargs="?", const=f.const)
        group.add_argument(f.flag, **kwargs)


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The table's flags the command line gave: field path -> the field's value."""
    return {f.field: f.value(getattr(args, f.dest)) for f in FLAGS if getattr(args, f.dest, None) is not None}


def name_flag(error: Exception, fields_given: dict[str, Any]) -> Exception:
    """A CaseError about a field a flag set, with the flag named after it: `optim.lr: expected a
    positive learning rate, got -1 (from --lr)`."""
    path = getattr(error, "field_path", None)
    flag = flag_of(path) if path in fields_given else None
    if flag is not None:
        error.args = (f"{error} (from {flag})",)
    return error


# ---- a case as flags ----------------------------------------------------------------------------


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def case_to_flags(case: Case) -> list[str]:
    """The flags that rebuild `case` from the built-in default (`check` with no `--case`): every
    field that differs from it, and only those. `case_from_args(parse(flags)) == case`, hash for
    hash (tests/test_case_flags.py draws the cases)."""
    from fsdp_verify.case import Case
    from fsdp_verify.case_specs import LossScaleSpec
    from fsdp_verify.models import ModelSpec

    default = Case()
    m = case.model
    out: list[str] = []
    if m.is_custom:
        base = ModelSpec(kind="custom", factory=m.factory)
        out += ["--model", m.factory]
    elif m.kind != default.model.kind:
        base = ModelSpec(kind=m.kind)
        out += ["--model", m.kind]
    else:
        base = default.model
    for f in FLAGS:
        if f.field.startswith("model.") and f.flag != "--model":
            name = f.field.split(".", 1)[1]
            if not _same(getattr(m, name), getattr(base, name)):
                out += f.tokens(getattr(m, name))
    if case.mesh_shape is not None:
        out += ["--mesh-shape", text(case.mesh_shape)]
    elif case.world_size != default.world_size:
        out += ["--world-size", text(case.world_size)]
    if case.wrap is not None:
        entries = [e for e in case.wrap if e != ""]
        out += ["--wrap", *(entries or ["root"])]
    for f in FLAGS:
        if f.field.startswith(("model.", "loss_scaling")) or f.field in ("world_size", "mesh_shape", "wrap"):
            continue
        value = _get(case, f.field)
        if not _same(value, _get(default, f.field)):
            out += f.tokens(value)
    if case.loss_scaling is not None:
        out.append("--loss-scaling")
        for f in FLAGS:
            if f.field.startswith("loss_scaling."):
                name = f.field.split(".", 1)[1]
                if not _same(getattr(case.loss_scaling, name), getattr(LossScaleSpec(), name)):
                    out += f.tokens(getattr(case.loss_scaling, name))
    return out


# ---- fuzz and sweep: values to pin or draw among ------------------------------------------------
def add_draw_flags(p: argparse.ArgumentParser) -> None:
    """The table's "pin" flags, each taking one value (pinned) or several (drawn among)."""
    groups: dict[str, Any] = {}
    for f in FLAGS:
        if f.draw != "pin":
            continue
        group = groups.get(f.group) or groups.setdefault(f.group, p.add_argument_group(f"draw: {f.group}"))
        switch = f.const is not _MISSING
        group.add_argument(
            f.flag,
            dest=f.dest,
            type=f.parse,
            nargs="*" if switch else "+",
            default=None,
            metavar=f.metavar,
            help=re.sub(r" \(default[^)]*\)", "", f.help)  # a draw's default is drawn
            + "; several values: drawn among them"
            + ("; alone: pinned on" if switch else ""),
        )


def _distinct(values: list[Any]) -> list[Any]:
    out: list[Any] = []
    for v in values:
        if not any(_same(v, w) for w in out):
            out.append(v)
    return out


def _pin(field: str, values: list[Any]) -> Any:
    """One value (pinned) or a strategy drawing among several, each checked as a pin first."""
    from hypothesis import strategies as st

    from fsdp_verify.case import check_field_value

    values = _distinct(values)
    for value in values:
        check_field_value(field, value)
    return values[0] if len(values) == 1 else st.sampled_from(values)


def draw_pins(args: argparse.Namespace) -> dict[str, Any]:
    """The draw flags given: field path -> a value (one given) or a strategy (several)."""
    pins: dict[str, Any] = {}
    for f in FLAGS:
        if f.draw != "pin":
            continue
        values = getattr(args, f.dest, None)
        if values is not None:
            pins[f.field] = _pin(f.field, [f.value(v) for v in values or [f.const]])
    return pins


def draw_flag_texts(args: argparse.Namespace) -> list[str]:
    """The draw flags given, as typed (`--optimizer adam sgd`): for a report's record of its draw."""
    out = []
    for f in FLAGS:
        values = getattr(args, f.dest, None) if f.draw == "pin" else None
        if values is not None:
            out.append(" ".join([f.flag, *(text(v) for v in values)]))
    return out


_TUPLE_VALUED = {"model.widths", "model.frozen", "ignored", "model.shrinkable", "optim.betas", "mesh_shape", "wrap"}
_NAME_TUPLES = {"model.frozen", "ignored", "model.shrinkable", "wrap"}


def keyword_pins(keywords: dict[str, Any], field_names: set[str]) -> dict[str, Any]:
    """The strategies' keywords with flag names (`optimizer`, `sync_last`, `lr`) turned into pins
    of their fields. A string is read as the flag reads it (`mesh_shape="2,2"`, `"bfloat16"`); a
    list draws among its items (for a tuple-valued field a list of plain items is one value); a
    strategy is drawn from; anything else pins. A Case field name that no flag spells alike
    (`data`, `optim.name`) keeps its meaning; other keys are left for the caller to name."""
    from hypothesis.strategies import SearchStrategy

    out: dict[str, Any] = {}
    for key, value in keywords.items():
        f = BY_DEST.get(key)
        if f is None or f.draw != "pin" or (key in field_names and f.field != key):
            out[key] = value
            continue

        def read(v: Any, f: Flag = f) -> Any:
            if isinstance(v, str):
                return f.value(f.parse(v))
            return f.value(tuple(v) if isinstance(v, list) else v)

        if isinstance(value, SearchStrategy):
            out[f.field] = value
        elif isinstance(value, list) and not _one_tuple(f.field, value):
            if not value:
                raise TypeError(f"{key}: expected a value or a non-empty list of values to draw among, got []")
            out[f.field] = _pin(f.field, [read(v) for v in value])
        else:
            out[f.field] = tuple(value) if isinstance(value, list) else read(value)
    return out


def _one_tuple(field: str, value: list) -> bool:
    """Is list `value` one value of a tuple-valued field (`frozen=["a", "b"]`, `betas=[0.9, 0.99]`)
    rather than values to draw among (`mesh_shape=[(2, 2), "1,4"]`)?"""
    if field not in _TUPLE_VALUED:
        return False
    if field in _NAME_TUPLES:
        return all(isinstance(v, str) for v in value)
    return all(not isinstance(v, (list, tuple, str)) and v is not None for v in value)
