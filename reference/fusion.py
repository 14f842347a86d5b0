"""The floor under compiled-against-eager: an eager reference run with every operation moved by
what a compiler may change in it, so that a compiled reference that parts from eager by more
than that carries the compiler's bug (verify/checks/compiler.py), and one within it does not.

What a compiler (Inductor, AOTAutograd's decompositions) may change in a graph, against eager
running the same operations one by one, while computing the same function:

* the order of a reduction's additions (a sum, a mean, a matmul's inner products, a softmax's
  normaliser, an attention's rows, a scatter-add's duplicates): two orders of n terms differ by
  at most 2 (n - 1) u sum|terms| (first order in u; u the unit roundoff of the accumulation,
  fp32's for fp32, bf16 and fp16 inputs, as both ATen and Inductor accumulate those in fp32);
* an intermediate kept in fp32 inside a fused kernel where eager rounds it to bf16 or fp16: one
  rounding, u_out |y| of the output's dtype (so also an explicit cast down that a fused kernel
  keeps in registers: Inductor's `emulate_precision_casts` is off by default);
* an elementwise result contracted (a multiply-add as one FMA), regrouped, or a division done
  as a multiplication by the reciprocal: two roundings at most, 2 u |y|;
* a transcendental function from another implementation (Inductor's vectorised kernels, or a
  decomposition such as SiLU as x / (1 + exp(-x))): two evaluations within 1 ulp of the exact
  value each, so within 2 ulp (4 u |y|) of each other.

Data movement (views, copies, concatenation, indexing, an embedding's gather), selection
(where, clamp, max), comparisons and random draws are exact both ways: not moved.

The magnitudes, per operation (`_bound`): for an operation that is a sum of products with
non-negative coefficients (mm, addmm, bmm, sum, mean, an embedding's scatter-add, a loss that
adds terms of one sign) sum|terms| is the operation evaluated on the inputs' absolute values;
softmax and its backward, log-softmax and its backward, and attention are written out below,
each from its formula. Where a bound holds only under a condition (attention's probability rows
summing to one) it is an upper bound.

As the perturbation of reductions (reference/perturbation.py) does: each element moves by its
bound with a random sign, and the run carries the moves through everything downstream (the
loss, the backward, Adam, the next steps). Its deviation from the eager reference is the floor;
every record is judged against NOISE_MULTIPLE times it (never below the fp32 bound), since
every record only inherits moves through roundings that flip (verify/compare/tolerance.py).

The moves are made where the compiled run has graphs: in forward, inside the compiled modules
only (the root's own operations under "units" run eagerly on both sides); in backward, every
operation, the loss's backward and the root's too (autograd does not say which graph made a
node): an over-estimate there, which makes the floor higher, never lower.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from fsdp_verify.compare.tolerance import unit_roundoff

# Exact both ways: moving bits, choosing among inputs, comparing, drawing at random.
_EXACT = {
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "slice", "select", "squeeze",
    "unsqueeze", "unbind", "split", "split_with_sizes", "alias", "detach", "clone", "copy_", "cat", "stack",
    "index", "index_select", "gather", "embedding", "select_backward", "slice_backward", "zeros", "zeros_like",
    "ones", "ones_like", "empty", "empty_like", "empty_strided", "new_zeros", "new_ones", "new_empty", "full",
    "full_like", "fill_", "zero_", "arange", "lift_fresh", "scalar_tensor", "where", "clamp", "clamp_min",
    "clamp_max", "maximum", "minimum", "max", "min", "amax", "amin", "argmax", "relu", "threshold_backward",
    "neg", "abs", "masked_fill", "masked_fill_", "bernoulli_", "uniform_", "normal_", "rand", "randn",
    "randint", "native_dropout", "_local_scalar_dense", "contiguous", "as_strided", "expand_as", "flatten",
}  # fmt: skip
# Within 1 ulp of the exact value in each implementation.
_TRANSCENDENTAL = {
    "exp", "expm1", "log", "log1p", "log2", "tanh", "sigmoid", "silu", "silu_backward", "gelu",
    "gelu_backward", "sin", "cos", "rsqrt", "sqrt", "pow", "erf", "reciprocal", "softplus",
}  # fmt: skip
# Sums of products with non-negative coefficients: sum|terms| is the operation on |inputs|.
_LINEAR_REDUCTIONS = {"mm", "addmm", "bmm", "baddbmm", "sum", "mean", "dot", "mv", "embedding_dense_backward"}


class FusionJolt(TorchDispatchMode):
    """Moves each result a compiler may compute otherwise by its bound (module docstring). Pushed
    around a rank's forward (moving only inside `compiled` modules, `attach`) and its backward."""

    def __init__(self, seed: int):
        super().__init__()
        self.generator = torch.Generator().manual_seed(seed)
        self.inside = 0  # compiled modules the forward is in now
        self.backward = False
        self.quiet = False

    def attach(self, modules: list[nn.Module]) -> None:
        """Count the forward's depth in the modules the case compiles."""
        for module in modules:
            module.register_forward_pre_hook(lambda *_: self._enter())
            module.register_forward_hook(lambda *_: self._leave())

    def _enter(self) -> None:
        self.inside += 1

    def _leave(self) -> None:
        self.inside -= 1

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        with self, torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    # A compiled backward need not read what its forward computed: AOTAutograd's partitioner
    # (under Inductor, min-cut rematerialisation) saves some activations and recomputes others
    # inside the backward graph, from the saved ones, fused otherwise than the forward (fuzz seed
    # 20270409, case 9098ae89d0e5: the compiled reference 1.04x its bound in bf16 with the
    # forward's moves alone). It recomputes pointwise operations only (torch 2.13's
    # functorch config: `ban_recompute_reductions`, `ban_recompute_not_in_allowlist`; a matmul is
    # never recomputed), so a value the backward reads moves from the one the forward used by one
    # pointwise evaluation's bound: within a transcendental's 4 u |y| (the widest, above), and by
    # one rounding of its dtype where one of them kept it in fp32 and the other rounded it. So each
    # activation a compiled module saves is moved again by that, with its own random signs, when
    # the backward unpacks it; not the parameters and inputs a graph takes (they are its inputs,
    # never recomputed), nor a value eager saves as it is (an integer, an empty tensor).
    def _pack(self, t: torch.Tensor):
        recomputable = self.inside and _floating(t) and t.grad_fn is not None
        return (t, recomputable)

    def _unpack(self, packed) -> torch.Tensor:
        t, recomputable = packed
        if not recomputable:
            return t
        self.quiet = True  # the move's own arithmetic is not the compiled graph's: not moved again
        try:
            bound = 4 * _u_acc(t) * t.double().abs() + _rounding(t)
            signs = torch.randint(0, 2, t.shape, generator=self.generator).double() * 2 - 1
            return (t.double() + signs * bound).to(t.dtype)
        finally:
            self.quiet = False

    @contextlib.contextmanager
    def backward_pass(self) -> Iterator[None]:
        self.backward = True
        try:
            with self:
                yield
        finally:
            self.backward = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if self.quiet or not (self.backward or self.inside) or name in _EXACT or func.is_view:
            return out
        if any(_wrapper(t) for t in _tensors((args, kwargs, out))):
            # A tensor subclass's op (torchao's float8 tensors): its own implementation runs the
            # plain ops it is made of, which come through here and are moved themselves.
            return out
        results = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if _floating(t)]
        for i, t in enumerate(results):
            bound = _bound(func, i, t, args, kwargs)
            if bound is not None:
                signs = torch.randint(0, 2, t.shape, generator=self.generator).double() * 2 - 1
                t.copy_((t.double() + signs * bound).to(t.dtype))
        return out


def _wrapper(t: torch.Tensor) -> bool:
    """A traceable wrapper subclass (its data in inner tensors, `__tensor_flatten__`)."""
    return hasattr(t, "__tensor_flatten__")


def _floating(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0


def _u_acc(t: torch.Tensor) -> float:
    """The unit roundoff a reduction accumulates in: fp32's for fp32 and narrower, else its own."""
    return unit_roundoff(torch.float64) if t.dtype == torch.float64 else unit_roundoff(torch.float32)


def _rounding(t: torch.Tensor) -> torch.Tensor | float:
    """The output rounding a fused kernel may skip: one u of a dtype narrower than fp32."""
    u = unit_roundoff(t.dtype)
    return u * t.double().abs() if u > unit_roundoff(torch.float32) else 0.0


def _tensors(args) -> list[torch.Tensor]:
    return [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)]


def _bound(func, index: int, y: torch.Tensor, args, kwargs) -> torch.Tensor | None:
    """The largest move of result `index` (`y`) of aten op `func` a compiler may make, per element."""
    name = func.overloadpacket.__name__
    u, a = _u_acc(y), y.double().abs()
    if name == "_to_copy":  # a cast: a fused kernel may keep the value in fp32 (a cast up is exact)
        rounding = _rounding(y)
        return rounding if isinstance(rounding, torch.Tensor) else None
    if name in _TRANSCENDENTAL:
        return 4 * u * a + _rounding(y)
    if name in _LINEAR_REDUCTIONS:
        n = _reduced_terms(name, args, y)
        return 2 * max(n - 1, 0) * u * _on_absolutes(func, args, kwargs) + u * a + _rounding(y)
    bound = _written_out(name, index, y, args, kwargs, u)
    if bound is not None:
        return bound + _rounding(y)
    # Any other elementwise arithmetic (add, mul, the backward of tanh): a contraction into an FMA,
    # or a division done as a multiplication by the reciprocal: two roundings at most.
    return 2 * u * a + _rounding(y)


def _reduced_terms(name: str, args, y: torch.Tensor) -> int:
    """How many terms each result of a linear reduction adds."""
    x = _tensors(args)
    if name in ("mm", "bmm", "dot", "mv"):
        return x[0].shape[-1]
    if name in ("addmm", "baddbmm"):
        return x[1].shape[-1] + 1
    if name == "embedding_dense_backward":
        return x[1].numel()  # at most every index adds into one row
    return max(x[0].numel() // max(y.numel(), 1), 1)  # sum, mean


def _on_absolutes(func, args, kwargs) -> torch.Tensor:
    """The operation on the absolute values of its floating inputs and scalars, in float64:
    sum|terms| of each result."""
    flat, spec = tree_flatten((args, kwargs))
    absolute = [a.double().abs() if _floating(a) else abs(a) if isinstance(a, float) else a for a in flat]
    new_args, new_kwargs = tree_unflatten(absolute, spec)
    if "dtype" in new_kwargs:
        new_kwargs["dtype"] = torch.float64
    return func(*new_args, **new_kwargs).double().abs()


def _written_out(name: str, index: int, y: torch.Tensor, args, kwargs, u: float) -> torch.Tensor | None:
    """Softmax, log-softmax, their backward passes, the losses and attention, from their formulas."""
    a = y.double().abs()
    if name == "_softmax":  # y = exp(x) / sum exp(x): the normaliser's order, and exp's ulps
        n = args[0].shape[args[1]]
        return (2 * (n - 1) + 4) * u * a
    if name == "_log_softmax":  # y = x - log sum exp(x): the sum's relative error, absolutely
        n = args[0].shape[args[1]]
        return (2 * (n - 1) + 4) * u * (1 + a)
    if name == "_softmax_backward_data":  # g_in = y (g - sum(g y))
        g, out, dim = args[0].double(), args[1].double(), args[2]
        n, dots = out.shape[dim], (g * out).abs().sum(dim, keepdim=True)
        return 2 * (n - 1) * u * out.abs() * dots + 4 * u * out.abs() * (g.abs() + dots)
    if name == "_log_softmax_backward_data":  # g_in = g - exp(y) sum(g)
        g, out, dim = args[0].double(), args[1].double(), args[2]
        n, total = out.shape[dim], g.abs().sum(dim, keepdim=True)
        return 2 * (n - 1) * u * out.exp() * total + 4 * u * (g.abs() + out.exp() * total)
    if name in ("nll_loss_forward", "mse_loss") and index == 0:  # terms of one sign: sum|terms| = |sum|
        n = args[1].numel() if name == "nll_loss_forward" else args[0].numel()
        return 2 * max(n - 1, 0) * u * a + u * a
    if name.startswith("_scaled_dot_product") and name.endswith("backward"):
        return _attention_backward(index, y, args, kwargs, u)
    if name.startswith("_scaled_dot_product"):
        return _attention_forward(index, y, args, kwargs, u)
    return None


def _attention_scale(q: torch.Tensor, kwargs) -> float:
    scale = kwargs.get("scale")
    return scale if scale is not None else 1 / math.sqrt(q.shape[-1])


def _score_error(q: torch.Tensor, k: torch.Tensor, s: float, u: float) -> torch.Tensor:
    """The largest move of a score s q.k (d products added), per batch and head: 2 (d - 1) u s
    d max|q| max|k|. A softmax moves by at most twice its inputs' largest move, relatively."""
    d = q.shape[-1]
    qmax = q.double().abs().amax(dim=(-2, -1), keepdim=True)
    kmax = k.double().abs().amax(dim=(-2, -1), keepdim=True)
    return 2 * max(d - 1, 0) * u * s * d * qmax * kmax


def _attention_forward(index: int, y: torch.Tensor, args, kwargs, u: float) -> torch.Tensor | None:
    """out = P V with P = softmax(s q k^T) (rows summing to one, so P |V| <= max over keys |V|):
    the scores' moves (relative 2 e_z on P), the normaliser's (2 (L - 1) u) and the weighted sum's
    (2 (L - 1) u) orders; the log-sum-exp: its sum's and the scores' moves."""
    q, k, v = (t for t in _tensors(args)[:3])
    length, s = k.shape[-2], _attention_scale(q, kwargs)
    e_z = _score_error(q, k, s, u)
    if index == 0:
        vmax = v.double().abs().amax(dim=-2, keepdim=True)  # per batch, head and column
        return (4 * (length - 1) * u + 2 * e_z) * vmax + 4 * u * y.double().abs()
    if index == 1 and y.dim() >= 2:  # the log-sum-exp per query
        return (2 * (length - 1) + 4) * u * (1 + y.double().abs()) + e_z.squeeze(-1)
    return None


def _attention_backward(index: int, y: torch.Tensor, args, kwargs, u: float) -> torch.Tensor | None:
    """(dq, dk, dv) from dO, q, k, v, O: with P <= 1, rows summing to one, |dS_ij| <= P_ij
    |dO_i|_1 (max|V| + max|O|), so |dq_i| <= s |dO_i|_1 (max|V| + max|O|) max|K|, |dk_j| <= s
    sum_i |dO_i|_1 (max|V| + max|O|) max|Q| and |dv_j| <= sum_i |dO_i|; each sums at most
    n = max(L_q, L_k, d) terms, and the probabilities carry the scores' move."""
    grad_out, q, k, v, out = (t.double() for t in _tensors(args)[:5])
    s = _attention_scale(q, kwargs)
    n = max(q.shape[-2], k.shape[-2], q.shape[-1])
    e_z = _score_error(q, k, s, u)
    row = grad_out.abs().sum(-1, keepdim=True)  # |dO_i|_1, per query
    spread = v.abs().amax(dim=(-2, -1), keepdim=True) + out.abs().amax(dim=(-2, -1), keepdim=True)
    if index == 0:
        magnitude = s * row * spread * k.abs().amax(dim=(-2, -1), keepdim=True)
    elif index == 1:
        magnitude = s * row.sum(-2, keepdim=True) * spread * q.abs().amax(dim=(-2, -1), keepdim=True)
    elif index == 2:
        magnitude = grad_out.abs().sum(-2, keepdim=True)
    else:
        return None
    return (2 * (n - 1) * u + 2 * e_z) * magnitude.expand(y.shape) + 4 * u * y.double().abs()
