"""What float8 training costs in numbers, apart from what sharding breaks (issue 51): the reference
(one device, no sharding) of a case with float8 on, against the same case with it off, in bf16
parameters with an fp32 reduction; per step the loss's relative difference and the logits'
normwise relative difference, and after the last step the parameters'. Each recipe, on the
built-in Transformer and on a tiny Llama (transformers), three steps.

    python bench/float8_cost.py [--steps 3] [--json out.json]

A measurement, not a check: the toolkit's verdicts compare the sharded run with the reference of
the same case, float8 on both sides, bit for bit; how far float8 moves training from bf16 is
the user's trade, shown here and in docs/float8.md.
"""

from __future__ import annotations

import argparse
import json

import torch
from _hygiene import private_tmp

from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import DataSpec
from fsdp_verify.dims.float8 import RECIPES, Float8Spec
from fsdp_verify.reference import train_reference

MODELS = {
    "built-in Transformer (dim 32, ffn 48, 2 layers)": ModelSpec(
        kind="transformer", dim=32, ffn_hidden=48, n_layers=2, vocab_size=40, seq_len=8
    ),
    "tiny Llama (transformers; hidden 32, intermediate 64, 2 layers)": ModelSpec(
        kind="custom",
        factory="fsdp_verify.models.hf:tiny_llama",
        seq_len=8,
        kwargs={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2},
    ),
}


def _case(model: ModelSpec, steps: int, float8: Float8Spec) -> Case:
    case = Case(model=model, world_size=2, steps=steps, data=DataSpec(batch_size=8))
    return case.with_(**{"precision.param_dtype": "bf16", "precision.reduce_dtype": "fp32", "dims.float8": float8})


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def cost(model: ModelSpec, steps: int, recipe: str) -> dict:
    f8 = train_reference(_case(model, steps, Float8Spec(recipe)))
    bf16 = train_reference(_case(model, steps, Float8Spec()))
    loss = [_rel(f8.records[(s, "loss", "loss")], bf16.records[(s, "loss", "loss")]) for s in range(1, steps + 1)]
    logits = [
        _rel(f8.records[(s, "logits", "logits")], bf16.records[(s, "logits", "logits")]) for s in range(1, steps + 1)
    ]
    params = [k for k in bf16.records if k[0] == steps and k[1] == "params"]
    moved = max(_rel(f8.records[k], bf16.records[k]) for k in params)
    return {"loss": loss, "logits": logits, "params_worst": moved}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    out = {}
    for name, model in MODELS.items():
        for recipe in RECIPES:
            row = cost(model, args.steps, recipe)
            out[f"{name} / {recipe}"] = row
            print(
                f"{name:60s} {recipe:20s} loss {' '.join(f'{x:.2e}' for x in row['loss'])}"
                f"  logits {' '.join(f'{x:.2e}' for x in row['logits'])}  params (worst) {row['params_worst']:.2e}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    with private_tmp("float8_cost"):
        main()
