"""What float8 costs, held to what its casts allow: the package's own check (phase "dims").

The verdict compares the sharded run with a reference that computes the same float8, so a float8
bug both share (torchao's, or a scale computed wrongly the same way on both sides) passes it. This
check holds float8 itself to its rounding: the reference run again, eagerly, every converted
module watched, and each of its three matmuls (the output `x @ W.T`, the input's gradient
`g @ W`, the weight's `g.T @ x`, as torchao's `matmul_with_hp_or_float8_args` computes them)
compared with the same product in float64 of the same high-precision operands, the run's own
values (the module's output, the gradients autograd delivers).

Why a bound per matmul, and not on the whole run: a product's error is derived from its casts
alone; how it grows through the model's nonlinearities and the optimizer (AdamW's normalised
update turns a rounding into a whole learning rate) is not, and a bound on the trained model's
drift would need calibrating per model (the drift is measured and said beside, against the same
case without float8: `drift`).

The bound, elementwise, from torchao's arithmetic (torchao/float8/float8_utils.py,
float8_scaling_utils.py, float8_ops.py):

- A cast of `t` with scale `s` (`amax_to_scale`: the format's max over an amax, tensorwise or per
  row, in float64 then float32; halved at most by `round_scales_to_power_of_2`) rounds `t * s`
  to the format: at most half an ulp, `u = eps / 2` of it (e4m3 2^-4, e5m2 2^-3) where normal,
  half the subnormal spacing below (e4m3 2^-10, e5m2 2^-17). In `t`'s units, with `1 / s` at
  most `2 * amax / max` (the tensor's amax bounds every row's):
  `|cast(t) - t| <= (u + 2^-23) |t| + h * 2 * max(amax(t), 1e-12) / max`  (2^-23: the fp32
  product `t * s` and the clamp of a scale rounded up; 1e-12: torchao's least amax, `EPS`).
- A product of two casts: `|A^ B^ - A B| <= eA |B| + |A| eB + eA eB` summed over the inner
  dimension, plus the fp32 accumulation and the scales' product (`gamma = k 2^-24 / (1 - k
  2^-24) + 2^-23` of `|A^| |B^|`), plus each rounding to the output's dtype (`u_out` of the
  value: the product's, the bias's cast and its addition in forward; the product's and the cast
  to the weight's dtype for its gradient).
- A cast the recipe disables (`rowwise_with_gw_hp`'s weight gradient) has no rounding term.

A correct float8 stays within it by construction (the measured worst is in docs/float8.md); a
scale from the wrong amax saturates its largest values, a dequantisation by the wrong scale moves
every value: both land far outside it (tests/test_float8_rounding.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from fsdp_verify import module_names
from fsdp_verify.compare.tolerance import unit_roundoff

COMPARATOR = "Float8Rounding"
PHASE = "dims"  # a dimension's own check (verify/trace.py)
F32_MORE = 2.0**-23  # the fp32 product t * s and a scale rounded up, in units of the value
MATMULS = {
    "forward": "x @ W.T",
    "grad_input": "g @ W",
    "grad_weight": "g.T @ x",
}


def cast_error(t: torch.Tensor, cast) -> torch.Tensor:
    """Elementwise bound of |cast(t) - t| (float64) for torchao's `CastConfig` `cast` (above)."""
    from torchao.float8.config import ScalingType

    if cast.scaling_type is ScalingType.DISABLED:
        return torch.zeros_like(t)
    fmt = torch.finfo(cast.target_dtype or torch.float8_e4m3fn)
    half_subnormal = fmt.smallest_normal * fmt.eps / 2  # half the spacing below the normal range
    amax = max(float(t.abs().max()) if t.numel() else 0.0, amax_floor())
    return (fmt.eps / 2 + F32_MORE) * t.abs() + half_subnormal * 2 * amax / fmt.max


def amax_floor() -> float:
    """The least amax torchao scales by (`float8_utils.EPS`: a tensor of tinier values, a
    gradient that vanished, is cast as if its amax were this, so its roundings are coarser than
    its own amax says); 1e-12 in torchao 0.18, read where present."""
    from torchao.float8 import float8_utils

    return float(getattr(float8_utils, "EPS", 1e-12))


def roundings(cast_a, cast_b, out_dtype: torch.dtype) -> list[torch.dtype]:
    """The dtypes a product is rounded to on its way out, as torchao's `addmm_float8_unwrapped`
    computes it: once to `out_dtype`; with both operands scaled per row, `torch._scaled_mm` in
    bf16 where the output is fp32 or fp16, then the scales multiplied in afterwards (one more
    rounding in that dtype), then the cast back."""
    from torchao.float8.config import ScalingGranularity, ScalingType

    rowwise = all(
        c.scaling_type is not ScalingType.DISABLED and c.scaling_granularity is ScalingGranularity.AXISWISE
        for c in (cast_a, cast_b)
    )
    if not rowwise:
        return [out_dtype]
    mm = torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype
    return [mm, mm] + ([out_dtype] if out_dtype != mm else [])


def product_bound(
    a: torch.Tensor, b: torch.Tensor, exact: torch.Tensor, cast_a, cast_b, out_dtype: torch.dtype
) -> torch.Tensor:
    """Elementwise bound of |float8 a @ b - a @ b| (operands float64, 2-D; `exact` their product,
    which the caller compares against too), the product rounded on its way to `out_dtype` as
    `roundings` says."""
    ea, eb = cast_error(a, cast_a), cast_error(b, cast_b)
    aa, ab = a.abs(), b.abs()
    k = a.shape[-1]
    gamma = k * 2.0**-24 / (1 - k * 2.0**-24) + F32_MORE
    bound = ea @ ab + aa @ eb + ea @ eb
    bound = bound + gamma * ((aa + ea) @ (ab + eb))
    size = exact.abs()
    for dtype in roundings(cast_a, cast_b, out_dtype):
        bound = bound + unit_roundoff(dtype) * (size + bound)
    return bound


def recast(bound: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype, to: torch.dtype) -> torch.Tensor:
    """`bound` with one more rounding, where autograd casts a product of `dtype` to `to`."""
    return bound if to == dtype else bound + unit_roundoff(to) * (exact.abs() + bound)


@dataclass
class Measured:
    """One matmul of one module at one step: its worst element against the bound."""

    step: int
    module: str
    matmul: str
    ratio: float  # max over elements of |float8 - float64| / bound
    max_abs: float  # that element's |float8 - float64|
    allowed: float  # and its bound
    relative: float  # normwise, ||float8 - float64|| / ||float64||: what float8 moved it by
    casts: str


def _measure(
    step: int, module: str, matmul: str, got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, casts: str
):
    diff = (got.double() - exact).abs()
    ratio = torch.where(bound > 0, diff / bound.clamp_min(torch.finfo(torch.float64).tiny), diff * float("inf"))
    ratio = torch.nan_to_num(ratio, nan=0.0)  # 0 * inf: an exact element with a zero bound
    worst = int(ratio.argmax()) if ratio.numel() else 0
    norm = float(exact.norm())
    return Measured(
        step,
        module,
        matmul,
        float(ratio.flatten()[worst]) if ratio.numel() else 0.0,
        float(diff.flatten()[worst]) if diff.numel() else 0.0,
        float(bound.flatten()[worst]) if bound.numel() else 0.0,
        float(diff.norm()) / norm if norm > 0 else float(diff.max() if diff.numel() else 0.0),
        casts,
    )


def _short(cast) -> str:
    try:
        return cast.short_str()
    except (KeyError, AttributeError):
        return str(cast)


@dataclass
class _Call:
    """One forward of a converted module: its operands, in float64, until its backward."""

    x: torch.Tensor  # (rows, in)
    weight: torch.Tensor  # (out, in)
    g: torch.Tensor | None = None  # (rows, out), from the output's hook
    g_dtype: torch.dtype = torch.float32  # the dtype the products of the backward come out in

    def got(self, g: torch.Tensor) -> None:
        self.g, self.g_dtype = g.detach().reshape(-1, g.shape[-1]).double(), g.dtype


@dataclass
class Watch:
    """Hooks on every converted module of the reference's model; what they measured."""

    step: int = 1
    measured: list[Measured] = field(default_factory=list)
    handles: list = field(default_factory=list)
    # Per weight tensor (a step's compute copy, kept alive here with its hook): the calls whose
    # products its gradient sums, until that gradient arrives.
    calls: dict[int, tuple[torch.Tensor, list[_Call]]] = field(default_factory=dict)
    _forward: dict[int, _Call] = field(default_factory=dict)  # a module's call, pre to post hook

    def attach(self, model: nn.Module) -> None:
        from torchao.float8.float8_linear import Float8Linear

        for fqn, module in model.named_modules():
            if isinstance(module, Float8Linear):
                name = module_names.original(fqn)
                self.handles.append(module.register_forward_pre_hook(self._pre(name)))
                self.handles.append(module.register_forward_hook(self._post(name)))

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.calls.clear()

    def _pre(self, name: str):
        def pre(mod: nn.Module, args: tuple):
            x = args[0]
            call = self._forward[id(mod)] = _Call(x.detach().reshape(-1, x.shape[-1]).double(), _plain(mod.weight))
            if not x.requires_grad:
                return None
            alias = x.view_as(x)  # this module's own use of x: its hook sees this module's gradient alone
            alias.register_hook(lambda gx: self._grad_input(name, mod, call, gx))
            return (alias, *args[1:])

        return pre

    def _post(self, name: str):
        def post(mod: nn.Module, args: tuple, out: torch.Tensor):
            c, call = mod.config, self._forward.pop(id(mod))
            w = call.weight.detach().double()
            exact = call.x @ w.T
            bound = product_bound(call.x, w.T, exact, c.cast_config_input, c.cast_config_weight, out.dtype)
            if mod.bias is not None:
                b = mod.bias.detach().double()
                u = unit_roundoff(out.dtype)
                bound = bound + u * b.abs() + u * (exact.abs() + bound + b.abs())  # its cast, its addition
                exact = exact + b
            casts = f"input {_short(c.cast_config_input)}, weight {_short(c.cast_config_weight)}"
            got = out.detach().reshape(-1, out.shape[-1])
            self.measured.append(_measure(self.step, name, "forward", got, exact, bound, casts))
            if not out.requires_grad:
                return None
            out.register_hook(lambda g: call.got(g))
            weight = call.weight
            if weight.requires_grad:
                if id(weight) not in self.calls:
                    self.calls[id(weight)] = (weight, [])
                    weight.register_hook(lambda gw: self._grad_weight(name, mod, weight, gw))
                self.calls[id(weight)][1].append(call)
            return None

        return post

    def _grad_input(self, name: str, mod: nn.Module, call: _Call, gx: torch.Tensor) -> None:
        if call.g is None:
            return
        c, w = mod.config, call.weight.detach().double()
        exact = call.g @ w
        cast_go, cast_w = c.cast_config_grad_output, c.cast_config_weight_for_grad_input
        bound = product_bound(call.g, w, exact, cast_go, cast_w, call.g_dtype)
        bound = recast(bound, exact, call.g_dtype, gx.dtype)
        casts = f"grad_output {_short(c.cast_config_grad_output)}, weight {_short(c.cast_config_weight_for_grad_input)}"
        got = gx.detach().reshape(-1, gx.shape[-1])
        self.measured.append(_measure(self.step, name, "grad_input", got, exact, bound, casts))

    def _grad_weight(self, name: str, mod: nn.Module, weight: torch.Tensor, gw: torch.Tensor) -> None:
        """The weight's gradient this pass: the sum of its calls' products (each output's hook has
        run by now: the weight's product needs that gradient)."""
        c = mod.config
        _, calls = self.calls[id(weight)]
        done = [call for call in calls if call.g is not None]
        if not done:
            return
        exact = torch.zeros(gw.shape, dtype=torch.float64)
        bound = torch.zeros(gw.shape, dtype=torch.float64)
        cast_go, cast_x = c.cast_config_grad_output_for_grad_weight, c.cast_config_input_for_grad_weight
        for call in done:
            part = call.g.T @ call.x
            held = product_bound(call.g.T, call.x, part, cast_go, cast_x, call.g_dtype)
            held = recast(held, part, call.g_dtype, gw.dtype)
            exact, bound = exact + part, bound + held
        if len(done) > 1:  # each call's product rounded, then their sum
            bound = bound + len(done) * unit_roundoff(gw.dtype) * (exact.abs() + bound)
        calls.clear()
        casts = f"grad_output {_short(cast_go)}, input {_short(cast_x)}"
        self.measured.append(_measure(self.step, name, "grad_weight", gw.detach(), exact, bound, casts))


def _plain(weight: torch.Tensor) -> torch.Tensor:
    """A weight read through torchao's float8 all-gather wrapper (its high-precision tensor)."""
    inner = getattr(weight, "_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else weight


_ACTIVE: list[Watch] = []  # the watch `convert_reference` attaches to the model it converts


@contextlib.contextmanager
def watching() -> Iterator[Watch]:
    """A Watch that the reference's conversion attaches (`attach_if_watching`), its step counted
    by the optimizer's steps."""
    watch = Watch()

    def stepped(optimizer, args, kwargs) -> None:
        watch.step += 1

    handle = register_optimizer_step_post_hook(stepped)
    _ACTIVE.append(watch)
    try:
        yield watch
    finally:
        _ACTIVE.remove(watch)
        handle.remove()
        watch.close()


def attach_if_watching(model: nn.Module) -> None:
    if _ACTIVE:
        _ACTIVE[-1].attach(model)


def watched_case(case):
    """The case as this check runs it: eager and without activation checkpointing (the products
    are the same; a compiled graph would not call the modules' hooks, a checkpointed unit would
    call them twice). The compiler's own check holds the compiled run to eager."""
    from fsdp_verify.checks.compiler import eager_case

    return eager_case(case).with_(activation_checkpointing=False)


def check(spec, case) -> list:
    """Findings of phase "dims": each matmul of a converted module, at each step, whose worst
    element parts from float64 by more than its bound; or one passing finding that says how close
    the worst came, how far float8 moved the products, and how far it moved the whole run from the
    same case without float8 (`drift`)."""
    from fsdp_verify.compare.finding import Finding
    from fsdp_verify.engines import engine_arithmetic
    from fsdp_verify.reference import train_reference
    from fsdp_verify.training.threads import rank_like_threads

    eager = watched_case(case)
    arithmetic = engine_arithmetic(case.engine)
    with rank_like_threads(), watching() as watch:
        with_float8 = train_reference(eager, arithmetic=arithmetic)
        measured = list(watch.measured)
    if not measured:
        return [
            Finding(
                0, PHASE, f"<{COMPARATOR}>", True, "skipped", COMPARATOR, "float8's rounding: no converted module ran"
            )
        ]
    worst: dict[tuple[int, str, str], Measured] = {}
    for m in measured:  # each step's worst pass (rank, micro-batch) of each product
        key = (m.step, m.module, m.matmul)
        if key not in worst or m.ratio > worst[key].ratio:
            worst[key] = m
    failed = [m for m in worst.values() if not m.ratio <= 1]
    if failed:
        return [_failure(m) for m in failed]
    top = max(worst.values(), key=lambda m: m.ratio)
    moved = max(m.relative for m in worst.values())
    modules = len({m.module for m in worst.values()})
    message = (
        f"every float8 product within the rounding bound of its casts ({len(worst)} products of {modules} converted"
        f" modules over {case.steps} step(s)), the worst at {top.ratio:.2g} of its bound ({top.module}"
        f" {top.matmul}, step {top.step}); float8 moved the products by up to {moved:.2g} (normwise)"
    )
    drifted = drift(case, eager, with_float8, arithmetic)
    if drifted:
        message += f"; the logits part from the same case without float8 by {drifted} (measured, not held)"
    return [Finding(0, PHASE, f"<{COMPARATOR}>", True, "check", COMPARATOR, message)]


def drift(case, eager, with_float8, arithmetic) -> str:
    """How far float8 moves the run's logits at each step from the same case without it
    (normwise, the reference of each): what float8 costs, said, not held (above)."""
    from fsdp_verify.dims.float8 import NAME, Float8Spec
    from fsdp_verify.reference import train_reference
    from fsdp_verify.training.threads import rank_like_threads

    with rank_like_threads():
        without = train_reference(eager.with_(**{f"dims.{NAME}": Float8Spec()}), arithmetic=arithmetic)
    parts = []
    for step in range(1, case.steps + 1):
        key = (step, "logits", "logits")
        if key in with_float8.records and key in without.records:
            a, b = with_float8.records[key].double(), without.records[key].double()
            norm = float(b.norm())
            parts.append(f"{float((a - b).norm()) / norm:.2g}" if norm > 0 else "0")
    if not parts:
        return ""
    return f"{', '.join(parts)} at step{'s' if len(parts) > 1 else ''} 1{f'-{len(parts)}' if len(parts) > 1 else ''}"


def _failure(m: Measured):
    from fsdp_verify.compare.finding import Finding

    message = (
        f"{m.module}, {m.matmul} ({MATMULS[m.matmul]}; {m.casts}): the float8 product parts from the same product"
        f" in float64 by {m.max_abs:.3g} where its casts allow {m.allowed:.3g}, {m.ratio:.3g}x the bound; float8's"
        " own arithmetic (torchao's), not the sharding's: the sharded run is compared with a reference computing"
        " the same float8"
    )
    return Finding(
        m.step,
        PHASE,
        f"float8.{m.module}.{m.matmul}",
        False,
        "deviation",
        COMPARATOR,
        message,
        max_abs=m.max_abs,
        normwise=m.ratio,
        tolerance=1.0,
        mode="elementwise, in units of the derived bound",
    )
