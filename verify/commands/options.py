"""What several commands share, with one spelling everywhere (the pytest plugin's options use the
same parsers): exit codes, dtypes (`fp32`/`float32`, `bf16`/`bfloat16`, `fp16`/`float16`), lists of
world sizes or precisions (`1 2 3`, `1,2,3` or both), engines, and the options that build a Case.
Free of torch, so the pytest plugin can use it while pytest parses its command line."""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from fsdp_verify import dtypes
from fsdp_verify.commands import case_flags
from fsdp_verify.commands.flag import _items, dtype
from fsdp_verify.commands.run_flags import MODEL
from fsdp_verify.dims.parallel_dims import ParallelDims
from fsdp_verify.trust import add_trust_argument, typed

if TYPE_CHECKING:
    from fsdp_verify.case import Case
    from fsdp_verify.models import ModelSpec

EXIT_OK, EXIT_DIVERGED, EXIT_BAD_INPUT, EXIT_INFRA = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  # Ctrl-C (fuzz, sweep): 128 + SIGINT, as a shell reports it
ENGINE_HELP = "fsdp2 | fsdp1 | flat | pkg.module:NAME | path/to/file.py:NAME"
MODEL_HELP = "pkg.module:NAME | path/to/file.py:NAME (a factory NAME(**kwargs) -> nn.Module)"
PRECISION_POLICIES = dtypes.PRECISION_POLICIES
DRAWABLE_POLICIES = dtypes.DRAWABLE_POLICIES


# ---- value parsers (argparse `type=`; also used by the pytest plugin) ---------------------------
def engine_name(text: str) -> str:
    from fsdp_verify.engines import canonical_engine

    return canonical_engine(text)


def world_sizes(text: str) -> list[int]:
    """`2`, `2,4` or `2 4` -> [2, 4]."""
    try:
        sizes = [int(s) for s in _items(text)]
    except ValueError:
        sizes = []
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"expected positive integers (e.g. 1,2,4 or 1 2 4), got {text!r}")
    return sizes


def model_kinds(text: str) -> list[str]:
    """`mlp,transformer` or `mlp transformer` -> the built-in model kinds to draw."""
    kinds = _items(text)
    if not kinds or any(k not in ("mlp", "transformer") for k in kinds):
        raise argparse.ArgumentTypeError(f"expected mlp and/or transformer (e.g. mlp,transformer), got {text!r}")
    return kinds


def precisions(text: str) -> list[str]:
    """`fp32,bf16`, `float32 bfloat16`, ... -> ["fp32", "bf16"] (the printed names)."""
    names = []
    for item in _items(text):
        name = dtype(item)
        if name not in DRAWABLE_POLICIES:
            raise argparse.ArgumentTypeError(f"expected precision policies among {DRAWABLE_POLICIES}, got {item!r}")
        names.append(name)
    if not names:
        raise argparse.ArgumentTypeError(f"expected precision policies among {DRAWABLE_POLICIES}, got {text!r}")
    return names


class ListOption(argparse.Action):
    """A list option that takes space- or comma-separated values, or both, and replaces its
    default (argparse's own "extend" would add to it)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, list(dict.fromkeys(v for value in values for v in value)))


def add_world_sizes(p: argparse.ArgumentParser, default: list[int] | None, help_text: str) -> None:
    p.add_argument(
        "--world-sizes", type=world_sizes, nargs="+", action=ListOption, default=default, metavar="N", help=help_text
    )


def add_precisions(p: argparse.ArgumentParser, default: list[str] | None = None) -> None:
    p.add_argument(
        "--precisions",
        type=precisions,
        nargs="+",
        action=ListOption,
        default=default or list(PRECISION_POLICIES),
        metavar="P",
        help="precision policies to draw: fp32 (full), bf16 (bf16 params, fp32 or bf16 reduction) and/or"
        " fp16 (fp16 params with dynamic loss scaling); float32/bfloat16/float16 accepted too"
        " (default: fp32 bf16)",
    )


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def add_timeout(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--timeout", type=positive_seconds, default=120.0, help="seconds a rank may go without finishing (default 120)"
    )


def add_engine_is_correct(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engine-is-correct",
        action="store_true",
        help="the engine is known correct (as the built-in ones are): a failure is then the toolkit's model at"
        " fault (a false alarm) or a bug in torch (a catch), and the report says so; without it a user's engine's"
        " failures are failures",
    )


def engine_correct(engine: str, marked: bool) -> str | None:
    """The report's `engine_correct`: "built-in" (fsdp2, fsdp1, flat), "marked" (--engine-is-correct)
    or None (a user's engine: its failures are failures, perhaps catches)."""
    from fsdp_verify.engines import BUILTIN, canonical_engine

    return "built-in" if canonical_engine(engine) in BUILTIN else "marked" if marked else None


def correct_engine_note(engine: str, correct: str | None) -> str | None:
    """The line under a known-correct engine's failures: whose failure each can be. None otherwise."""
    if correct is None:
        return None
    known = "a built-in engine" if correct == "built-in" else "marked correct (--engine-is-correct)"
    return (
        f"{engine} is {known}: each failure is the toolkit's model at fault (a false alarm) or a bug in torch"
        " (a catch); its repro tells which (docs/nightly.md, Whose failure)"
    )


# ---- a Case from the command line -------------------------------------------------------------
def add_case_arguments(p: argparse.ArgumentParser) -> None:
    """`--case FILE` and a flag for every Case field (verify/commands/case_flags.py, grouped as
    the Case nests them); shared by every command that builds a case."""
    p.add_argument("--case", type=Path, help="a Case JSON file (default: the built-in default case)")
    add_trust_argument(p)
    add_framework_argument(p)
    case_flags.add_flags(p)


def add_framework_argument(p: argparse.ArgumentParser) -> None:
    from fsdp_verify.frameworks import FRAMEWORKS

    p.add_argument(
        "--framework",
        choices=tuple(FRAMEWORKS),
        help="a framework's own FSDP2 code as the engine: sets the model (--model picks one: torchtitan's"
        " llama3:FLAVOR, or a transformers factory), the framework's units, its engine, loss and reduction;"
        " other flags apply on top (docs/frameworks/NAME.md)",
    )


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """`--model` and what a user's model factory takes, one value each (fuzz and sweep draw
    around the model they name)."""
    group = p.add_argument_group(MODEL)
    for f in case_flags.FLAGS:
        if f.draw == "fixed":
            group.add_argument(f.flag, dest=f.dest, type=f.parse, metavar=f.metavar, help=f.help, default=None)


def model_from_args(args: argparse.Namespace, current: ModelSpec | None = None, sizes: bool = True) -> ModelSpec | None:
    """The ModelSpec `--model` and its options name, or None when they change nothing. `sizes`:
    the built-in sizes (`--widths`, `--seq-len`, ...) too (in fuzz and sweep they are pins)."""
    import json

    from fsdp_verify.models import ModelSpec
    from fsdp_verify.models.spec import is_import_path
    from fsdp_verify.validation import CaseError

    name = getattr(args, "model", None)
    changes = {
        f.field.split(".", 1)[1]: f.value(getattr(args, f.dest))
        for f in case_flags.FLAGS
        if f.field.startswith("model.")
        and not f.special
        and (sizes or f.draw == "fixed")
        and getattr(args, f.dest, None) is not None
    }
    kwargs = getattr(args, "model_kwargs", None)
    if name is None and kwargs is None and not changes:
        return None
    base = current or ModelSpec()
    if name in ("mlp", "transformer"):
        if name != base.kind:
            base = ModelSpec(kind=name)
    elif name is not None:
        if not is_import_path(name):
            raise CaseError("model", f"'mlp', 'transformer' or {MODEL_HELP}", name)
        if not (base.is_custom and base.factory == name):  # the same factory keeps a case file's kwargs
            base = ModelSpec(kind="custom", factory=name)
    if kwargs is not None:
        try:
            changes["kwargs"] = json.loads(kwargs)
        except json.JSONDecodeError as e:
            raise CaseError("model.kwargs", f"a JSON object ({e})", kwargs) from None
        if not isinstance(changes["kwargs"], dict):
            raise CaseError("model.kwargs", "a JSON object", kwargs)
    return replace(base, **changes) if changes else base


def case_from_args(args: argparse.Namespace) -> Case:
    """The built-in default or --case, with the command-line overrides applied (a flag overrides
    the file's field). Raises CaseError, naming the flag where one set the field."""
    from fsdp_verify.case import Case
    from fsdp_verify.validation import CaseError

    if args.case and not Path(args.case).is_file():
        raise CaseError("--case", "a Case JSON file", str(args.case))
    case = load_case(args.case, None, args) if args.case else Case()
    # A framework's fields go in with the flags, one Case made of both: its pipeline's fields
    # need the flags' micro-batches, its tp fields the flags' degree.
    framework = framework_fields(args) if getattr(args, "framework", None) else {}
    flags = case_flags.given(args)
    try:
        return _apply_flags(case, args, flags, framework)
    except CaseError as e:
        raise case_flags.name_flag(e, flags) from None


def framework_fields(args: argparse.Namespace) -> dict:
    """The case fields `--framework` and `--model MODEL:FLAVOR` stand for (verify/frameworks/);
    `--model-kwargs` adds to the factory's keywords. The model flags are then spent."""
    import json

    from fsdp_verify.frameworks import preset
    from fsdp_verify.validation import CaseError

    kwargs = json.loads(args.model_kwargs) if getattr(args, "model_kwargs", None) else {}
    if not isinstance(kwargs, dict):
        raise CaseError("model.kwargs", "a JSON object", args.model_kwargs)
    asked = {name: _asked_degree(getattr(args, name, None)) for name in ("tp", "pp")}
    fields = preset(args.framework, getattr(args, "model", None), kwargs, getattr(args, "seq_len", None), **asked)
    args.model = args.model_kwargs = None
    return fields


def _asked_degree(degrees) -> bool:
    """Whether a dimension's flag (one degree, or a draw's list of them) asks for a degree above 1."""
    return any(d > 1 for d in (degrees if isinstance(degrees, list) else [degrees or 1]) if isinstance(d, int))


def framework_draw_pins(fields: dict) -> dict:
    """A framework's fields as a draw's pins, and what its code fixes: torchtitan trains in fp32
    or bf16 with an fp32 reduction and no output cast (`TrainingConfig`'s mixed_precision_*), so
    that is all the draw varies of the precision."""
    if not fields:
        return {}
    return {**fields, "precision.reduce_dtype": "fp32", "precision.output_dtype": None}


def _apply_flags(case: Case, args: argparse.Namespace, flags: dict, framework: dict | None = None) -> Case:
    """`case` with a framework's fields (field path -> value: `framework_fields`) and the flags
    in `flags` (field path -> value) over them applied."""
    framework = framework or {}
    changes = {
        f.field: flags[f.field]
        for f in case_flags.FLAGS
        if f.field in flags and not f.special and not f.field.startswith("model.")
    }
    before = case.with_(**{k: v for k, v in framework.items() if k in ("model", "wrap")}) if framework else case
    tp = flags.get("tp", case.tp)
    if "mesh_shape" in flags:
        changes["mesh_shape"] = flags["mesh_shape"]
        shape = flags["mesh_shape"] or ()
        if "world_size" not in flags and shape and all(isinstance(d, int) for d in shape):
            # the mesh is the data-parallel part: times the stages and tp
            changes["world_size"] = ParallelDims.over(tuple(shape), pp=flags.get("pp", case.pp), tp=tp).world_size
    if "world_size" in flags:
        changes["world_size"] = flags["world_size"]
        changes.setdefault("mesh_shape", None)
    model = model_from_args(args, before.model)
    if model is not None and model != before.model:
        changes["model"] = model
        if model.kind != before.model.kind or model.factory != before.model.factory:
            changes["wrap"] = None
    if args.wrap:
        changes["wrap"] = _wrap_plan(args.wrap)
    scaling = _loss_scaling(case, args, flags)
    if scaling is not case.loss_scaling:
        changes["loss_scaling"] = scaling
    world = changes.get("world_size", case.world_size)
    microbatches = changes.get("microbatches", case.microbatches)
    if "data.batch_size" in flags:
        changes["data.batch_size"] = flags["data.batch_size"]
    elif (not args.case or "microbatches" in changes) and isinstance(world, int) and world > 0:
        per = world * (microbatches if isinstance(microbatches, int) and microbatches > 0 else 1)
        changes["data.batch_size"] = -(-case.data.batch_size // per) * per
    changes = {**framework, **changes}
    return case.with_(**changes) if changes else case


def _wrap_plan(entries: list[str]) -> tuple[str, ...] | None:
    """`--wrap`'s entries: `root` stands for the root, added last if missing; `default` alone for
    the model's own plan (None)."""
    if entries == ["default"]:
        return None
    plan = tuple(e for e in entries if e != "root")
    return plan if plan and plan[-1] == "" else plan + ("",)


def _loss_scaling(case: Case, args: argparse.Namespace, flags: dict):
    """`--loss-scaling` (on, off or KEY=VALUE pairs) and the single-field flags over it; a field
    flag alone turns scaling on with the other fields as the case file's or the defaults."""
    from fsdp_verify.case_specs import LossScaleSpec
    from fsdp_verify.validation import CaseError

    spec = case.loss_scaling
    if getattr(args, "loss_scaling", None) is not None:
        spec = loss_scaling_from_text(args.loss_scaling)
    fields = {k.split(".", 1)[1]: v for k, v in flags.items() if k.startswith("loss_scaling.")}
    if not fields:
        return spec
    if spec is None and getattr(args, "loss_scaling", None) is not None:
        first = case_flags.flag_of(f"loss_scaling.{next(iter(fields))}")
        raise CaseError(first, "no loss scaling field with --loss-scaling off", args.loss_scaling)
    return replace(spec or LossScaleSpec(), **fields)


def loss_scaling_from_text(text: str):
    """`--loss-scaling`'s value: "" (the defaults), "off" (none) or KEY=VALUE pairs separated by
    commas. Raises CaseError naming the field (`loss_scaling.growth_interval: expected ...`)."""
    import json

    from fsdp_verify.case import loss_scaling_from_dict
    from fsdp_verify.validation import CaseError

    if text.strip().lower() in ("off", "none"):
        return None
    data: dict[str, object] = {}
    for item in _items(text):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CaseError("loss_scaling", "KEY=VALUE pairs (init_scale=65536,growth_interval=2000)", item)
        try:
            data[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            data[key.strip()] = value
    return loss_scaling_from_dict(data)


def load_case(path: Path, engine: str | None, args: argparse.Namespace | None = None) -> Case:
    """A case file with an optional engine override; code it names is run only as `args` allow
    (--trust-code, what the command line typed; verify/trust.py). Raises CaseError or OSError."""
    from fsdp_verify.case import Case

    trust_code = bool(getattr(args, "trust_code", False))
    case = Case.load(path, trust_code=trust_code, allowed=typed(args) if args is not None else ())
    return case.with_(engine=engine) if engine else case


DEFAULT_WORLD_SIZES = [1, 2, 3, 4]  # identity tells "--world-sizes not given" (see _mesh_world_sizes)


def add_draw_arguments(p: argparse.ArgumentParser) -> None:
    """What a generated draw may hold (fuzz, sweep): world sizes, precisions, the built-in models or
    a user's model, and pinned Case fields."""
    add_world_sizes(p, DEFAULT_WORLD_SIZES, "world sizes to draw, space- or comma-separated (default 1 2 3 4)")
    add_precisions(p)
    p.add_argument(
        "--models",
        type=model_kinds,
        nargs="+",
        action=ListOption,
        default=["mlp", "transformer"],
        metavar="KIND",
        help="built-in models to draw: mlp and/or transformer, space- or comma-separated (default: both);"
        " --model takes your own",
    )
    add_model_arguments(p)
    add_framework_argument(p)
    case_flags.add_draw_flags(p)
    p.add_argument(
        "--resume",
        action="store_true",
        help="draw a checkpoint and resume in every case: the step it saves after, the world size, mesh"
        " and engine it resumes on, and its tp, ep or pp degree where --tp, --ep or --pp asks (docs/resume.md)",
    )
    p.add_argument(
        "--compile-rate",
        type=compile_rate,
        default=None,
        metavar="RATE",
        help="the share of cases torch.compile is drawn in for an engine that takes it, 0 to 1, or a Hypothesis"
        " profile's (ci, dev: 0; nightly: 0.2; docs/compile.md); default: the profile's (fuzz --profile), 0 for"
        " sweep; --compile pins it in every case",
    )
    p.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="FIELD=JSON",
        help="fix a Case field in every generated case: --pin steps=1 --pin optim.name=sgd (repeatable)",
    )


def compile_rate(text: str) -> float:
    """`--compile-rate`: a number in [0, 1] or a profile's name (properties/profiles.py)."""
    from fsdp_verify.properties.profiles import COMPILE_RATES

    if text in COMPILE_RATES:
        return COMPILE_RATES[text]
    try:
        rate = float(text)
    except ValueError:
        rate = -1.0
    if not 0 <= rate <= 1:
        raise argparse.ArgumentTypeError(
            f"expected a number from 0 to 1 or one of {sorted(COMPILE_RATES)}, got {text!r}"
        )
    return rate


def _mesh_world_sizes(args: argparse.Namespace, pins: dict) -> list[int]:
    """`--mesh-shape` pins the mesh, so the world size too: the sizes of its meshes (those among
    `--world-sizes` where that was given). PinError when none is left."""
    from fsdp_verify.properties.pins import PinError

    if getattr(args, "mesh_shape", None) is None:
        return args.world_sizes
    sizes = sorted({math.prod(m) for m in args.mesh_shape if m})
    if not sizes:
        return args.world_sizes
    if args.world_sizes is not DEFAULT_WORLD_SIZES:
        given = [w for w in args.world_sizes if w in sizes]
        if not given:
            raise PinError(f"--mesh-shape: meshes of {sizes} ranks, none among --world-sizes {args.world_sizes}")
        return given
    return sizes


def pins_from_args(items: list[str]) -> dict[str, object]:
    """`FIELD=JSON` pairs; a value that is not JSON is taken as a string (`optim.name=sgd`).
    JSON lists become tuples, as Case fields hold them."""
    import json

    from fsdp_verify.properties.pins import PinError

    pins: dict[str, object] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise PinError(f"--pin: expected FIELD=VALUE, got {item!r}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        pins[key] = tuple(value) if isinstance(value, list) else value
    return pins


def strategy_from_args(args: argparse.Namespace, **options):
    """The case strategy the draw arguments name, the engine imported first (a bad one fails
    before any rank starts). Raises EngineLoadError, PinError, CaseError or OSError, each naming
    the argument."""
    from fsdp_verify.engines import resolve_engine
    from fsdp_verify.properties.strategies import cases
    from fsdp_verify.validation import CaseError

    if any(w < 1 for w in args.world_sizes):
        from fsdp_verify.properties.pins import PinError

        raise PinError(f"--world-sizes: expected positive integers, got {args.world_sizes}")
    framework = framework_fields(args) if getattr(args, "framework", None) else {}
    # --engine beside --framework wins, as `check` applies flags on top of the framework's fields
    # (its default, fsdp2, is None here until then); the report names the engine that ran
    framework_engine = framework.pop("engine", None)
    engine = args.engine = args.engine or framework_engine or "fsdp2"
    resolve_engine(engine)
    model = framework.pop("model", None) or model_from_args(args, sizes=False)
    custom = model if model is not None and model.is_custom else None
    try:
        pins = {**framework_draw_pins(framework), **case_flags.draw_pins(args), **pins_from_args(args.pin)}
    except CaseError as e:
        raise case_flags.name_flag(e, {e.field_path: None}) from None
    return cases(
        engine=engine,
        world_sizes=_mesh_world_sizes(args, pins),
        precisions=args.precisions,
        model_kinds=[model.kind] if model is not None and custom is None else args.models,
        custom_model=custom,
        **{"resume": getattr(args, "resume", False), "compile_rate": getattr(args, "compile_rate", None), **options},
        **pins,
    )
