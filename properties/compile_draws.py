"""torch.compile's draw step: the scope, the backend, `fullgraph` where the case allows it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from fsdp_verify import units
from fsdp_verify.case import Case, CaseError
from fsdp_verify.dims.together import not_modelled_beside
from fsdp_verify.properties.pins import pinned
from fsdp_verify.properties.profiles import profile_compile_rate


def compile_scopes(case: Case, rate: float, engine_scopes: tuple[str, ...] | None = None) -> SearchStrategy[str | None]:
    """None, or a compile scope with probability `rate` (the profile's: `profiles.COMPILE_RATES`):
    "units" where the plan has a unit besides the root, else "model"; for an engine that compiles
    only some scopes (`Capabilities.compile_scopes`: torchtitan's "blocks"), those the plan allows.
    "blocks" is otherwise drawn where asked (`--compile units model blocks`), so that a seed draws
    what it drew before. None where the case cannot be compiled (verify/dims/together.py: Case
    refuses them). Shrinks to None."""
    if rate <= 0 or not_modelled_beside(case, "compile") is not None:
        return st.just(None)
    scopes = ("units", "model") if len(case.wrap_plan) > 1 else ("model",)
    if engine_scopes is not None:
        has_block = any(units.is_block(u) for u in case.wrap_plan)
        scopes = tuple(s for s in (*scopes, "blocks") if s in engine_scopes and (s != "blocks" or has_block))
        if not scopes:
            return st.just(None)
    hundredths = round(100 * min(rate, 1.0))
    return st.integers(0, 99).flatmap(lambda k: st.sampled_from(scopes) if k >= 100 - hundredths else st.none())


def fullgraph_takes(case: Case) -> bool:
    """Whether fullgraph=True can hold: no unit's FSDP2 hooks (outside any graph) inside a
    compiled module (Case refuses the rest)."""
    from fsdp_verify.case_rules import fullgraph_breaks

    return fullgraph_breaks(case) is None


# Compile backends drawn unless pinned (see `with_compile`): Dynamo alone and Dynamo with
# AOTAutograd. Inductor where asked (`--compile-backend inductor`; the slow tests run it): a
# case of new shapes compiles new kernels, seconds each (docs/compile.md, Cost).
DRAWN_BACKENDS = ("eager", "aot_eager")


def with_compile(draw: Callable, case: Case, pins: dict[str, Any], rate: float | None) -> Case:
    """`case` with torch.compile drawn last (docs/compile.md), so that a seed's earlier draws stay
    what they were, and nothing drawn at all where the rate is 0 or the engine does not take it
    (`_knob_pins` pinned it off): a seed then draws what it drew before."""
    from fsdp_verify.checks.compiler import redraws_dropout
    from fsdp_verify.engines import engine_capabilities

    capabilities = engine_capabilities(case.engine)
    rate = profile_compile_rate() if rate is None else rate
    scope = draw(pinned(pins, "compile", compile_scopes(case, rate, capabilities.compile_scopes)))
    if scope is None:
        return case
    try:  # a pinned scope the drawn case cannot take ("units" with the root alone) is discarded
        with_scope = case.with_(compile=scope)
        takes = fullgraph_takes(with_scope)
        fullgraph_choices = st.booleans() if takes else st.just(False)
        if capabilities.compile_fullgraph is not None:  # the engine's way (torchtitan: always fullgraph)
            if capabilities.compile_fullgraph and not takes:
                assume("compile" not in pins)
                return case
            fullgraph_choices = st.just(capabilities.compile_fullgraph)
        fullgraph = draw(pinned(pins, "compile_fullgraph", fullgraph_choices))
        # Unpinned, among DRAWN_BACKENDS. Never the ingredients of a known
        # PyTorch bug (verify/checks/compiler.py `redraws_dropout`): then nothing is compiled, and
        # where the scope is pinned (`--compile units`) the draw is discarded instead.
        backends = [b for b in DRAWN_BACKENDS if not redraws_dropout(with_scope.with_(compile_backend=b))]
        if "compile_backend" not in pins and not backends:
            assume("compile" not in pins)
            return case
        backend = draw(pinned(pins, "compile_backend", st.sampled_from(backends)))
        compiled = with_scope.with_(compile_fullgraph=fullgraph, compile_backend=backend)
        # a pinned eager backend: the bug's other ingredients are not drawn beside it unless pinned too
        asked = "activation_checkpointing" in pins and ("model.dropout" in pins or "dropout" in pins)
        assume(asked or not redraws_dropout(compiled))
        return compiled
    except CaseError:
        assume(False)
        raise
