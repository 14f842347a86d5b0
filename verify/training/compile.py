"""torch.compile as a case asks for it (`Case.compile`, docs/compile.md), done alike on both
sides: the engine applies it (`ShardSpec.compile`), the reference compiles its own model with the
same call, so that the sharded run and the reference run the same graphs and a divergence
between them is the sharding's, not the compiler's (the compiler is checked on its own against
the eager reference: verify/checks/compiler.py).

Where: in place, `module.compile(...)` (its `__call__` runs a compiled `_call_impl`; parameter
FQNs stay, as torchtitan's in-place variant keeps them), after activation checkpointing
(verify/training/checkpointing.py replaces the forward on the instance, so the compiled forward
is the checkpointed one) and before `fully_shard`: torchtitan's order (AC, compile, FSDP).
Compilation is lazy, so the graphs are traced at the first forward, after sharding, whichever
side of `fully_shard` the call stands.

What: each unit of the wrap plan but the root ("units"), each unit that is a repeated block
("blocks": an element of a module list or dict, as torchtitan's `apply_compile` compiles each
block of `model.layers` and nothing else), or the whole model ("model"). `nn.Module.compile` does
not trace the module's own `_call_impl` (a file Dynamo skips), so a unit's hooks (FSDP2's pre- and
post-forward, themselves `_dynamo_disable`d) run eagerly around its compiled forward; under "model"
the graph breaks at every inner unit's hooks. A unit that is a `torch.nn` leaf (a plain
`nn.Embedding`) compiles nothing: its forward is in a skipped file too (pytorch/pytorch#150915);
the compile report counts frames, so it shows.

`dynamic=False`: each graph is a function of its inputs' shapes, not of the order in which a
process met them. A rank meets its own micro-batches, the reference every emulated rank's in one
process; with automatic dynamic shapes a shape met a second time compiles a dynamic kernel on one
side and a static one on the other, with other loops and so other roundings.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

from fsdp_verify.units import is_block, members


def compile_kwargs(case, dynamic: bool | None = False) -> dict[str, Any]:
    """`torch.compile`'s keyword arguments for the case: its backend and fullgraph, and `dynamic`,
    static shapes unless the engine compiles otherwise (`Capabilities.compile_dynamic`, which the
    reference passes: torchtitan compiles with torch's automatic dynamic shapes)."""
    return {"backend": case.compile_backend, "fullgraph": case.compile_fullgraph, "dynamic": dynamic}


def compiled_modules(case, model: nn.Module, plan: tuple[str, ...] | None = None) -> list[tuple[str, nn.Module]]:
    """(FQN, module) of what the case compiles: each unit but the root, each block, or the model
    (""). `plan`:
    the units `model` holds, if not the case's (a pipeline stage's, `stage_wrap`: a stage is
    compiled as a model of its own)."""
    if case.compile is None:
        return []
    if case.compile == "model":
        return [("", model)]
    # each module of a unit over several modules (verify/units.py), compiled on its own
    units = case.wrap_plan if plan is None else plan
    if case.compile == "blocks":
        units = tuple(u for u in units if is_block(u))
    return [(m, model.get_submodule(m)) for fqn in units if fqn for m in members(fqn)]


def compile_in_place(case, model: nn.Module, plan: tuple[str, ...] | None = None, dynamic: bool | None = False) -> None:
    """`module.compile(**compile_kwargs(case, dynamic))` on what the case compiles (`plan`: as
    above)."""
    kwargs = compile_kwargs(case, dynamic)
    for _, module in compiled_modules(case, model, plan):
        module.compile(**kwargs)


def is_compiled(module: nn.Module) -> bool | None:
    """Whether `module.compile()` was called on it (its `_compiled_call_impl` is set); None where a
    torch release keeps that elsewhere (not judged then)."""
    if "_compiled_call_impl" not in vars(module) and not hasattr(type(module), "_compiled_call_impl"):
        return None
    return getattr(module, "_compiled_call_impl", None) is not None


def fresh_compiler(options: tuple[tuple[str, Any], ...] = ()) -> None:
    """Dynamo's in-memory state dropped before a compiled case: every case compiles its own graphs
    (from Inductor's on-disk caches where it can, `use_cache_dir`) and counts its own compilations.
    Without it a long-lived process (a pool's rank, the parent running the references) would reach
    Dynamo's recompile limit per code object (a unit class's `forward`, shared by every case) and
    silently run the cases after that eagerly. Dynamo's options are put back to this process's
    own (an engine's compile may set some process-wide: torchtitan's `apply_compile`, whose next
    case in a warm rank would trace under them), then `options` set: the engine's declared ones
    (`Capabilities.dynamo_config`), for the reference."""
    import torch._dynamo
    from torch._dynamo.utils import clear_compilation_metrics, counters, set_compilation_metrics_limit

    _restore_dynamo_options()
    for name, value in options:
        setattr(torch._dynamo.config, name, value)

    use_cache_dir()
    # Inductor compiles in this process (no pool of compile workers per rank: a pool's W ranks
    # and the reference's parent would start 2 each on a machine of a few cores, for kernels of a
    # tiny model); the code it generates is the same.
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1
    # As torchtitan does wherever it checkpoints or compiles (pytorch/pytorch#166926): Dynamo tries
    # a frame's cached graphs most recently used first, so a checkpointed unit's recomputation in
    # backward can run another graph than its forward did (a unit of the same class whose child
    # FSDP2 made a unit of its own guards otherwise), and checkpoint's check of the saved tensors
    # fails ("A different number of tensors was saved": sweep seed 4101, case 96057a5e8b38).
    # Insertion order runs the same graph again.
    set_lru_cache = getattr(torch._C._dynamo.eval_frame, "_set_lru_cache", None)
    if set_lru_cache is not None:
        set_lru_cache(False)
    torch._dynamo.reset()
    counters.clear()
    set_compilation_metrics_limit(4096)  # the compile probe reads them step by step (64 by default)
    clear_compilation_metrics()


@contextlib.contextmanager
def compiling(options: tuple[tuple[str, Any], ...] = ()) -> Iterator[None]:
    """A compiled case in this process: `fresh_compiler(options)` before, and Dynamo's options put
    back to the process's own after (the engine's declared ones are the reference's for the case
    only, not for whatever this process compiles next)."""
    fresh_compiler(options)
    try:
        yield
    finally:
        _restore_dynamo_options()


# Dynamo's options as this process had them before its first compiled case.
_DYNAMO_OPTIONS: dict[str, Any] = {}


def _restore_dynamo_options() -> None:
    """Each Dynamo option that differs from the process's own, put back (only those: setting every
    option again warns of the deprecated ones)."""
    import torch._dynamo.config as config

    now = config.get_config_copy()
    if not _DYNAMO_OPTIONS:
        _DYNAMO_OPTIONS.update(now)
        return
    for name, value in _DYNAMO_OPTIONS.items():
        if name in now and now[name] != value:
            setattr(config, name, copy.deepcopy(value))  # the snapshot stays the process's own


CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def use_cache_dir() -> str:
    """Inductor's caches (the FX graph cache and the compiled kernels) in one directory for every
    process of the toolkit on this machine: the reference's parent, each pool's ranks (forked from
    a zygote, each taking its pool's environment when forked), pytest-xdist workers and later
    runs. $TORCHINDUCTOR_CACHE_DIR when set; else $FSDP_VERIFY_CACHE_DIR/inductor, else
    ~/.cache/fsdp-verify/inductor. Processes share it safely: Inductor writes its entries
    atomically (a rename) under a key of the graph, its inputs' shapes and the compiler's
    configuration and version, and compiles a kernel under a file lock; two processes compiling
    the same graph at once write the same entry. Set in this process's environment, so the
    pools started after it pass it on."""
    chosen = os.environ.get(CACHE_ENV)
    if not chosen:
        base = os.environ.get("FSDP_VERIFY_CACHE_DIR") or str(Path.home() / ".cache" / "fsdp-verify")
        chosen = str(Path(base) / "inductor")
        os.environ[CACHE_ENV] = chosen
    Path(chosen).mkdir(parents=True, exist_ok=True)
    return chosen
