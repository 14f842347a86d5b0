"""PyTorch's own bug, reproduced with plain torch (no fsdp-verify code): FSDP1 NO_SHARD with bf16
parameters crashes in the forward after a `no_sync` micro-batch when the model ties two weights.

FSDP1 (`use_orig_params=True`, `MixedPrecision(param_dtype=bfloat16)`) keeps a `no_sync`
micro-batch's gradient in the FlatParameter, in bf16; under NO_SHARD (world size 1, or a shard
group of one) the next forward assigns views of it to the fp32 original parameters, and with a
tied weight (an embedding shared with the output layer) torch refuses: "attempting to assign a
gradient with dtype 'c10::BFloat16' to a tensor with grad_dtype 'Float'" (torch 2.13; 2.8 says
"... to a tensor with dtype 'float'"). The same model untied runs; reduce_dtype fp32 crashes the
same way. Found by fsdp-verify's property draw (regression 3b1a3075ce79: a tied Transformer,
2 micro-batches without sync).
"""

import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn


class TiedModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(5, 4)
        self.hidden = nn.Linear(4, 4)
        self.out = nn.Linear(4, 5, bias=False)
        self.out.weight = self.embed.weight  # tied, as a language model's embedding and output

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.embed(tokens))))


@pytest.mark.xfail(
    strict=True,
    raises=RuntimeError,  # the refused gradient assignment; a fix makes this pass
    reason="torch 2.13: FSDP1 NO_SHARD with bf16 parameters and a tied weight assigns the no-sync "
    "micro-batch's bf16 gradient to the fp32 parameter in the next forward, which torch refuses",
)
def test_fsdp1_no_shard_bf16_tied_model_runs_a_second_micro_batch_after_no_sync():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'rendezvous')}", rank=0, world_size=1)
        try:
            model = TiedModel()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # NO_SHARD's deprecation warning
                fsdp = FSDP(
                    model,
                    sharding_strategy=ShardingStrategy.NO_SHARD,
                    use_orig_params=True,
                    mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
                    device_id=torch.device("cpu"),
                )
            tokens = torch.randint(0, 5, (2, 3), generator=torch.Generator().manual_seed(1))
            with fsdp.no_sync():  # the first micro-batch accumulates without reducing
                fsdp(tokens).float().sum().backward()
            fsdp(tokens).float().sum().backward()  # the second: FSDP1 crashes in this forward
            grad = model.embed.weight.grad
        finally:
            dist.destroy_process_group()
    assert grad is not None and bool(torch.isfinite(grad).all())
