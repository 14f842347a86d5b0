"""Where the routing of a model's experts decides what FSDP2 reduces, and the known limit of
torch 2.13 there. The fsdp2 engine sets `set_reduce_scatter_unused_params(True)` for routed
experts (verify/engines/spec.py), so that a rank whose samples skip an expert still takes part in
its reduce-scatter, with zeros. What that setting leaves data-dependent: whether the layer after
the experts gets an input that requires grad, when everything before the experts and their gate
is frozen and some experts train but not all. FSDP2 then reduce-scatters that layer's unit in
backward on a rank whose sample reached a trainable expert and in the root's post-backward
callback on another: the ranks issue their reduce-scatters in different orders (gloo aborts with
a collective mismatch). A PyTorch bug (`ORDER_REPRO`, a strict xfail); the draws leave it out
(properties/strategies.py) and a crash that fits it says so."""

from __future__ import annotations

ORDER_REPRO = "tests/upstream/test_fsdp2_unused_params_reduce_order.py"


def routing_decides_requires_grad(model) -> bool:
    """Whether the routing of `model`'s per-expert loop (an MLP's `moe`, after its first block)
    decides if the output of the experts requires grad: the first block and the gate frozen, one
    expert with a trainable parameter and another with none (before any unfreezing)."""
    from fsdp_verify.models import is_frozen, parameter_names

    if not model.experts or model.grouped_experts is not None or not model.frozen:
        return False
    names = parameter_names(model)
    before = [n for n in names if n.startswith("layers.0.") or n.startswith("moe.gate.")]
    experts = [[n for n in names if n.startswith(f"moe.experts.{e}.")] for e in range(model.experts)]
    trains = [any(not is_frozen(model, n) for n in expert) for expert in experts]
    return all(is_frozen(model, n) for n in before) and any(trains) and not all(trains)


def known_crash(case) -> str:
    """What a collective mismatch in a rank's run of `case` is likely to be, where the case has
    every ingredient of the bug above; else ""."""
    if case is None or not routing_decides_requires_grad(case.model):
        return ""
    return (
        "; this case has every ingredient of a known PyTorch bug (torch 2.13): the routing decides whether the"
        " layer after the experts gets an input that requires grad (the first block and the gate frozen, some"
        " experts trainable), and FSDP2 then orders its reduce-scatters by the routing even with"
        f" set_reduce_scatter_unused_params(True). Repro: {ORDER_REPRO}"
    )
