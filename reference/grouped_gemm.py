"""Expert parallelism over a grouped GEMM: where the ep rank that holds an expert adds up its
weight's gradient (torchtitan's `GroupedExperts`, whose `_grouped_mm` seam runs
`torch._grouped_mm` on the tokens sorted by expert; docs/frameworks/torchtitan.md).

Under expert parallelism the rank that holds expert e receives the rows every rank of its ep
group routed to e, one source after the other in rank order (the all-to-all's rank-major order,
`_permute`d expert-major), and takes e's weight gradient as one product over all of them:
`torch._grouped_mm`'s backward sums every source's rows at once and rounds that sum once (to
bf16, the experts' compute dtype there). The reference's one-rank passes would give each rank's
own product, rounded once per rank, and add those: another number. So here each pass keeps, for
each grouped GEMM, its rows and their output gradient, and gives the weight no gradient; after a
micro-batch's passes the holder's gradient is computed as the holder computes it, by the op's
own backward (`torch.autograd.grad` of `torch._grouped_mm`) on the rows of every source of its
ep group in source-rank order, against its own experts' slice of the weight. A row's product and
the input's gradient do not depend on the rows beside it, so those are the pass's own (every
record bit-exact against torchtitan's ranks: tests/test_torchtitan.py).

Which weight a call multiplies by is the module's call order: torchtitan's forward runs `w1`,
`w3`, then `w2` (`CALLS`); a module with other parameters is refused by name.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
from torch import nn

from fsdp_verify.models.moe import grouped_experts_modules
from fsdp_verify.reference.expert_parallel import ep_groups
from fsdp_verify.validation import CaseError

# torchtitan's `GroupedExperts.forward`: silu(x @ w1) * (x @ w3), then @ w2, each a grouped GEMM.
CALLS = ("w1_EFD", "w3_EFD", "w2_EDF")

# One product's rows from one pass: (A, its output's gradient, the offsets, B_t as multiplied).
Rows = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class _KeptRows(torch.autograd.Function):
    """`torch._grouped_mm(A, B_t, offs)`, whose backward gives A its gradient by the op's own
    backward and keeps (A, grad, offs, B_t) in `kept` instead of giving B_t one (zeros)."""

    @staticmethod
    def forward(ctx, a, b_t, offs, kept: list):
        ctx.save_for_backward(a, b_t, offs)
        ctx.kept = kept
        return torch._grouped_mm(a, b_t, offs=offs)

    @staticmethod
    def backward(ctx, grad):
        a, b_t, offs = ctx.saved_tensors
        with torch.enable_grad():
            leaf = a.detach().requires_grad_(True)
            (grad_a,) = torch.autograd.grad(torch._grouped_mm(leaf, b_t.detach(), offs=offs), leaf, grad)
        ctx.kept.append((a.detach(), grad.detach(), offs, b_t.detach()))
        return grad_a, torch.zeros_like(b_t), None, None


class HolderGrads:
    """The grouped GEMMs of one reference model, their rows kept pass by pass (`pass_rows`), and
    the ep holders' weight gradients made from them (`holders`)."""

    def __init__(self, case, modules: list[tuple[str, nn.Module]]):
        self.case = case
        self.modules = modules
        self.kept: dict[str, list[Rows]] | None = None  # the current pass's, by parameter name

    @classmethod
    def install(cls, case, model: nn.Module) -> HolderGrads | None:
        """On every grouped experts module with a `_grouped_mm` seam; None where there is none
        (the built-in experts add per-source chunks instead: reference/expert_parallel.py)."""
        modules = [(n, m) for n, m in grouped_experts_modules(model) if callable(getattr(m, "_grouped_mm", None))]
        if not modules:
            return None
        held = cls(case, modules)
        for fqn, module in modules:
            names = {n for n, _ in module.named_parameters(recurse=False)}
            if names != set(CALLS):
                raise CaseError(
                    "ep",
                    f"1 for grouped experts with parameters other than {list(CALLS)} (at {fqn!r}: not modelled)",
                    case.ep,
                )
            module.register_forward_pre_hook(lambda m, _args: setattr(m, "_kept_calls", 0))
            module._grouped_mm = types.MethodType(held._seam(fqn), module)
        return held

    def _seam(self, fqn: str):
        def grouped_mm(module, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
            if self.kept is None:  # outside a rank's pass (a forward without gradient)
                return torch._grouped_mm(A, B_t, offs=offs)
            call = module._kept_calls
            module._kept_calls = call + 1
            return _KeptRows.apply(A, B_t, offs, self.kept.setdefault(f"{fqn}.{CALLS[call]}", []))

        return grouped_mm

    @contextlib.contextmanager
    def pass_rows(self) -> Iterator[dict[str, list[Rows]]]:
        """Around one rank's pass: the rows its grouped GEMMs keep, by parameter name."""
        self.kept = kept = {}
        try:
            yield kept
        finally:
            self.kept = None

    def names(self) -> set[str]:
        return {f"{fqn}.{p}" for fqn, _ in self.modules for p in CALLS}

    def holders(self, rank_grads: list[dict[str, torch.Tensor]], rows: list[dict[str, list[Rows]]]):
        """Each data-parallel rank's grouped GEMM weight gradients as its ep rank holds them after
        backward: for its own experts, the op's backward over its ep group's rows of each expert,
        source after source; zeros for the others (another ep rank holds them)."""
        out = [dict(g) for g in rank_grads]
        ep = self.case.ep
        for name in self.names():
            if name not in rank_grads[0]:
                continue
            for members in ep_groups(self.case):
                for j, holder in enumerate(members):
                    out[holder][name] = self._held(
                        name, j, ep, [rows[s][name] for s in members], rank_grads[holder][name]
                    )
        return out

    @staticmethod
    def _held(name: str, j: int, ep: int, sources: list[list[Rows]], like: torch.Tensor) -> torch.Tensor:
        """Holder j's gradient of parameter `name` (its experts' slice; zeros elsewhere), summed
        over every call of its product in the pass (one, or one a recomputation never adds)."""
        held = torch.zeros_like(like)
        experts = like.shape[0]
        local = experts // ep
        mine = slice(j * local, (j + 1) * local)
        for call in range(len(sources[0])):
            b_t = sources[0][call][3][mine]
            a_rows, g_rows, counts = [], [], []
            for e in range(mine.start, mine.stop):
                n = 0
                for src in sources:
                    a, g, offs, _ = src[call]
                    start = int(offs[e - 1]) if e else 0
                    stop = int(offs[e])
                    a_rows.append(a[start:stop])
                    g_rows.append(g[start:stop])
                    n += stop - start
                counts.append(n)
            offs = torch.tensor(counts).cumsum(0).to(torch.int32)
            leaf = b_t.detach().requires_grad_(True)
            with torch.enable_grad():
                out = torch._grouped_mm(torch.cat(a_rows), leaf, offs=offs)
                (grad_b_t,) = torch.autograd.grad(out, leaf, torch.cat(g_rows))
            # B_t is the weight cast to the compute dtype and transposed: its gradient goes back
            # through both (`.bfloat16()`'s backward casts to the parameter's dtype).
            held[mine] += grad_b_t.transpose(-2, -1).to(like.dtype)
        return held
