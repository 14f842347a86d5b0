"""PyTorch's own bug, reproduced with plain torch (no fsdp-verify code): a full backward pre-hook
(`register_full_backward_pre_hook`) registered on a module after a compiled function that calls
it ran once is silently ignored: the cached graph runs on without it, no recompilation, no graph
break, no warning. Eager applies it. Found for fsdp-verify's zoo (`hook_dropped_by_compile`: an
engine that installs its averaging hook after the first forward, as engines driving reductions
from module hooks do); pytorch/pytorch#117265 (open) is this bug, its repro still fails on 2.13.
fsdp-verify's engines register every hook before the first forward; this test is the behaviour.
"""

import pytest
import torch
from torch import nn


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(3, 3, bias=False)
        self.second = nn.Linear(3, 1, bias=False)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def _weight_grad(compiled: bool) -> torch.Tensor:
    torch.manual_seed(0)
    net = _Net()
    run = torch.compile(net, backend="aot_eager") if compiled else net
    x = torch.randn(4, 3)
    run(x).sum().backward()  # the first call: compiled here, without the hook
    net.zero_grad()
    net.first.register_full_backward_pre_hook(lambda _m, grad_output: tuple(2 * g for g in grad_output))
    run(x).sum().backward()
    return net.first.weight.grad


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="torch 2.13: a full backward pre-hook registered after the first compiled call is ignored"
    " (pytorch/pytorch#117265)",
)
def test_a_backward_pre_hook_registered_after_the_first_compiled_call_is_applied():
    eager = _weight_grad(compiled=False)
    compiled = _weight_grad(compiled=True)
    torch.testing.assert_close(compiled, eager)  # the hook doubles the gradient in both
