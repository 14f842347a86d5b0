"""What several commands share, with one spelling everywhere (the pytest plugin's options use the
same parsers): exit codes, dtypes (`fp32`/`float32`, `bf16`/`bfloat16`, `fp16`/`float16`), lists of
world sizes or precisions (`1 2 3`, `1,2,3` or both), engines, and the options that build a Case.
Free of torch, so the pytest plugin can use it while pytest parses its command line."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from fsdp_verify import dtypes

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


def dtype(text: str) -> str:
    try:
        return dtypes.canonical(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _items(text: str) -> list[str]:
    return [s for s in text.replace(",", " ").split() if s]


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


# ---- a Case from the command line -------------------------------------------------------------
def add_case_arguments(p: argparse.ArgumentParser) -> None:
    """The Case overrides people change most; shared by every command that builds a case."""
    p.add_argument("--case", type=Path, help="a Case JSON file (default: the built-in default case)")
    p.add_argument("--engine", type=engine_name, help=ENGINE_HELP)
    p.add_argument("--world-size", type=int)
    p.add_argument("--steps", type=int)
    add_model_arguments(p)
    p.add_argument("--microbatches", type=int, help="micro-batches per step (gradient accumulation)")
    p.add_argument(
        "--wrap",
        nargs="+",
        metavar="ENTRY",
        help="the wrap plan: module FQNs and/or class names (LlamaDecoderLayer = every such module);"
        " children first, the root added last",
    )
    p.add_argument(
        "--padded", action="store_true", help="variable-length sequences padded with ignore_index (token models)"
    )
    p.add_argument("--data", metavar="IMPORT", help="a data function pkg.module:NAME, fn(case, step, generator)")
    p.add_argument("--loss", metavar="IMPORT", help="a loss pkg.module:NAME, loss(logits, targets) -> sum over items")
    add_step_arguments(p)
    p.add_argument("--param-dtype", type=dtype, metavar="DTYPE", help="fp32 | bf16 | fp16 (float32 ... accepted)")
    p.add_argument("--reduce-dtype", type=dtype, metavar="DTYPE", help="fp32 | bf16 | fp16 (float32 ... accepted)")
    p.add_argument("--output-dtype", type=dtype, metavar="DTYPE", help="fp32 | bf16 | fp16 (float32 ... accepted)")
    p.add_argument("--seed", type=int, help="the case's seed (initial values and dropout masks)")
    p.add_argument("--data-seed", type=int, help="the seed of the generated batches")
    p.add_argument("--batch-size", type=int, help="global batch (default: rounded up to fit the world size)")
    p.add_argument(
        "--loss-scaling",
        nargs="?",
        const="",
        metavar="KEY=VALUE,...",
        help="fp16 dynamic loss scaling on both sides (torch.amp.GradScaler / ShardedGradScaler on the"
        " sharded one, written out in the reference): optionally KEY=VALUE pairs joined by commas, keys"
        " init_scale (65536), growth_factor (2), backoff_factor (0.5), growth_interval (2000), the rest"
        " default; 'off' removes a case file's",
    )


def add_step_arguments(p: argparse.ArgumentParser) -> None:
    """`--step` and `--activation-checkpointing` (check, fuzz, sweep)."""
    p.add_argument(
        "--step",
        metavar="IMPORT",
        help="your training step pkg.module:NAME or file.py:NAME, NAME(model, optimizer, batch, ctx) -> loss,"
        " run unchanged on the reference and on every rank",
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="checkpoint every wrapped unit but the root (recomputation must replay dropout masks)",
    )


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """`--model` and what a user's model factory takes (shared by check, fuzz, ownership)."""
    p.add_argument("--model", metavar="MODEL", help=f"mlp | transformer | {MODEL_HELP}")
    p.add_argument("--model-kwargs", metavar="JSON", help="keyword arguments of a model factory, a JSON object")
    p.add_argument("--init-fn", metavar="IMPORT", help="init_fn(model, generator) run after the factory")
    p.add_argument("--output-fn", metavar="IMPORT", help="output_fn(output) -> logits, for a model's forward output")
    p.add_argument("--shrinkable", metavar="NAMES", help="integer model kwargs the shrinker may lower, comma-separated")
    p.add_argument("--seq-len", type=int, help="length of the generated token sequences")


def model_from_args(args: argparse.Namespace, current: ModelSpec | None = None) -> ModelSpec | None:
    """The ModelSpec `--model` and its options name, or None when they change nothing."""
    import json

    from fsdp_verify.models import ModelSpec
    from fsdp_verify.models.spec import is_import_path
    from fsdp_verify.validation import CaseError

    name = getattr(args, "model", None)
    extras = {k: getattr(args, k, None) for k in ("model_kwargs", "init_fn", "output_fn", "shrinkable")}
    if name is None and not any(v is not None for v in extras.values()) and getattr(args, "seq_len", None) is None:
        return None
    base = current or ModelSpec()
    if name in ("mlp", "transformer"):
        if name != base.kind:
            base = ModelSpec(kind=name)
    elif name is not None:
        if not is_import_path(name):
            raise CaseError("model", f"'mlp', 'transformer' or {MODEL_HELP}", name)
        base = ModelSpec(kind="custom", factory=name)
    changes: dict = {}
    if extras["model_kwargs"] is not None:
        try:
            changes["kwargs"] = json.loads(extras["model_kwargs"])
        except json.JSONDecodeError as e:
            raise CaseError("model.kwargs", f"a JSON object ({e})", extras["model_kwargs"]) from None
        if not isinstance(changes["kwargs"], dict):
            raise CaseError("model.kwargs", "a JSON object", extras["model_kwargs"])
    for key in ("init_fn", "output_fn"):
        if extras[key] is not None:
            changes[key] = extras[key]
    if extras["shrinkable"] is not None:
        changes["shrinkable"] = tuple(_items(extras["shrinkable"]))
    if getattr(args, "seq_len", None) is not None:
        changes["seq_len"] = args.seq_len
    return replace(base, **changes) if changes else base


def case_from_args(args: argparse.Namespace) -> Case:
    """The built-in default or --case, with the command-line overrides applied. Raises CaseError."""
    from fsdp_verify.case import Case
    from fsdp_verify.validation import CaseError

    if args.case and not Path(args.case).is_file():
        raise CaseError("--case", "a Case JSON file", str(args.case))
    case = Case.load(args.case) if args.case else Case()
    changes: dict = {}
    if args.engine:
        changes["engine"] = args.engine
    if args.world_size is not None:
        changes["world_size"] = args.world_size
        changes["mesh_shape"] = None
    for name in ("steps", "seed", "data_seed"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    model = model_from_args(args, case.model)
    if model is not None and model != case.model:
        changes["model"] = model
        if model.kind != case.model.kind or model.factory != case.model.factory:
            changes["wrap"] = None
    if args.wrap:
        plan = tuple(e for e in args.wrap if e != "root")
        changes["wrap"] = plan if plan and plan[-1] == "" else plan + ("",)
    if args.microbatches is not None:
        changes["microbatches"] = args.microbatches
    if args.padded:
        changes["data.padded"] = True
    if args.data:
        changes["data.fn"] = args.data
    if args.loss:
        changes["loss"] = args.loss
    if getattr(args, "step", None):
        changes["step"] = args.step
    if getattr(args, "activation_checkpointing", False):
        changes["activation_checkpointing"] = True
    for name in ("param_dtype", "reduce_dtype", "output_dtype"):
        if getattr(args, name):
            changes[f"precision.{name}"] = getattr(args, name)
    if getattr(args, "loss_scaling", None) is not None:
        changes["loss_scaling"] = loss_scaling_from_text(args.loss_scaling)
    world = changes.get("world_size", case.world_size)
    microbatches = changes.get("microbatches", case.microbatches)
    if args.batch_size is not None:
        changes["data.batch_size"] = args.batch_size
    elif (not args.case or "microbatches" in changes) and isinstance(world, int) and world > 0:
        per = world * (microbatches if isinstance(microbatches, int) and microbatches > 0 else 1)
        changes["data.batch_size"] = -(-case.data.batch_size // per) * per
    return case.with_(**changes) if changes else case


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


def load_case(path: Path, engine: str | None) -> Case:
    """A case file with an optional engine override. Raises CaseError or OSError."""
    from fsdp_verify.case import Case

    case = Case.load(path)
    return case.with_(engine=engine) if engine else case


def add_draw_arguments(p: argparse.ArgumentParser) -> None:
    """What a generated draw may hold (fuzz, sweep): world sizes, precisions, the built-in models or
    a user's model, and pinned Case fields."""
    add_world_sizes(p, [1, 2, 3, 4], "world sizes to draw, space- or comma-separated (default 1 2 3 4)")
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
    add_step_arguments(p)
    p.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="FIELD=JSON",
        help="fix a Case field in every generated case: --pin steps=1 --pin optim.name=sgd (repeatable)",
    )


def pins_from_args(items: list[str]) -> dict[str, object]:
    """`FIELD=JSON` pairs; a value that is not JSON is taken as a string (`optim.name=sgd`).
    JSON lists become tuples, as Case fields hold them."""
    import json

    from fsdp_verify.properties.strategies import PinError

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

    if any(w < 1 for w in args.world_sizes):
        from fsdp_verify.properties.strategies import PinError

        raise PinError(f"--world-sizes: expected positive integers, got {args.world_sizes}")
    resolve_engine(args.engine)
    model = model_from_args(args)
    custom = model if model is not None and model.is_custom else None
    pins = pins_from_args(args.pin)
    if getattr(args, "step", None):
        pins = {"step": args.step, **pins}
    if getattr(args, "activation_checkpointing", False):
        pins = {"activation_checkpointing": True, **pins}
    return cases(
        engine=args.engine,
        world_sizes=args.world_sizes,
        precisions=args.precisions,
        model_kinds=[model.kind] if model is not None and custom is None else args.models,
        custom_model=custom,
        **options,
        **pins,
    )
