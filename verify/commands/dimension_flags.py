"""The flag table's rows of the parallelism dimensions still spread over the toolkit (tp, ep, pp,
compile) and of resume; a dimension package (verify/dims/) brings its own rows instead. Free of
torch."""

from __future__ import annotations

from fsdp_verify.commands.flag import (
    Flag,
    boolean,
    integer,
    mesh,
    or_none,
)

TP = "tensor parallelism (docs/tensor-parallel.md)"
RESUME = "checkpoint and resume (docs/resume.md)"
EP = "expert parallelism (docs/expert-parallel.md)"
PP = "pipeline parallelism (docs/pipeline-parallel.md)"
COMPILE = "torch.compile (docs/compile.md)"

DIMENSION_FLAGS: tuple[Flag, ...] = (
    Flag(
        "--ep",
        "ep",
        EP,
        "the expert-parallel degree: the grouped experts (--top-k) sharded over an ep dim carved out of the shard"
        " dim, tokens moved by all-to-all; 1 = none (default)",
        integer,
        "N",
    ),
    Flag(
        "--pp",
        "pp",
        PP,
        "the pipeline degree: the model cut into stages over a pp dim of N ranks, --world-size counting every rank"
        " (pp x data-parallel) and --mesh-shape the data-parallel part; 1 = none (default)",
        integer,
        "N",
    ),
    Flag(
        "--pp-schedule",
        "pp_schedule",
        PP,
        "gpipe | 1f1b | interleaved1f1b (two stages a rank); torch.distributed.pipelining's (default 1f1b)",
        str,
        "NAME",
    ),
    Flag(
        "--pp-split",
        "pp_split",
        PP,
        "your split: fn(model, n_stages) -> the stage modules (sharing the model's parameters); none = the built-in"
        " model's blocks split evenly",
        or_none(str),
        "IMPORT",
    ),
    Flag(
        "--pp-scale-grads",
        "pp_scale_grads",
        PP,
        "the schedule divides the gradients by the micro-batches (torch's default: true); false: each micro-batch's"
        " loss is its share of the step's, as torchtitan's schedule has it",
        boolean,
        "BOOL",
    ),
    # tensor parallelism (docs/tensor-parallel.md)
    Flag(
        "--tp",
        "tp",
        TP,
        "the tensor-parallel degree: the ranks form the mesh (dp, tp) or (replicate, shard, tp), --world-size counting"
        " every rank (dp x tp) and --mesh-shape the data-parallel part; 1 = none (default)",
        integer,
        "N",
    ),
    Flag(
        "--tp-plan",
        "tp_plan",
        TP,
        "your plan: a dict of module FQN to ParallelStyle, or a function (model, tp_mesh) returning one; none = the"
        " built-in model's, or a transformers model's own base_model_tp_plan",
        or_none(str),
        "IMPORT",
    ),
    Flag(
        "--sequence-parallel",
        "sequence_parallel",
        TP,
        "the built-in Transformer's plan with sequence parallelism (SequenceParallel norms)",
        boolean,
        "BOOL",
        const=True,
    ),
    Flag(
        "--loss-parallel",
        "loss_parallel",
        TP,
        "the head's output sharded over the vocabulary, the cross-entropy under loss_parallel()",
        boolean,
        "BOOL",
        const=True,
    ),
    # checkpoint and resume: drawn together by fuzz/sweep --resume (their values depend on the
    # steps, world size and engine drawn), so no draw option of their own
    Flag(
        "--resume-after",
        "resume_after",
        RESUME,
        "save a checkpoint after step K and resume from it (torch.distributed.checkpoint); none = no resume",
        or_none(integer),
        "K",
        draw=None,
    ),
    Flag(
        "--resume-world-size",
        "resume_world_size",
        RESUME,
        "ranks the run resumes on (default: as before)",
        or_none(integer),
        "N",
        draw=None,
    ),
    Flag(
        "--resume-mesh-shape",
        "resume_mesh_shape",
        RESUME,
        "SHARD or REPLICATE,SHARD the run resumes on (default: 1-D, or as before)",
        mesh,
        "R,S",
        draw=None,
    ),
    Flag(
        "--resume-engine",
        "resume_engine",
        RESUME,
        "the engine the run resumes with (e.g. fsdp2 after fsdp1; default: as before)",
        or_none(str),
        "ENGINE",
        draw=None,
    ),
    Flag(
        "--resume-tp",
        "resume_tp",
        RESUME,
        "the tp degree the run resumes with (--resume-world-size still counts every rank; default: as before)",
        or_none(integer),
        "N",
        draw=None,
    ),
    Flag(
        "--resume-ep",
        "resume_ep",
        RESUME,
        "the expert-parallel degree the run resumes with (DCP reshards the experts; default: as before)",
        or_none(integer),
        "N",
        draw=None,
    ),
    Flag(
        "--resume-pp",
        "resume_pp",
        RESUME,
        "the pipeline degree the run resumes with (default: as before)",
        or_none(integer),
        "N",
        draw=None,
    ),
    Flag(
        "--compile",
        "compile",
        COMPILE,
        "units (each unit of the wrap plan but the root, in place, before fully_shard) | blocks (each unit"
        " that is an element of a module list or dict: torchtitan's per-block compile) | model (the whole"
        " model) | none; the reference is compiled alike and checked against eager",
        or_none(str),
        "SCOPE",
    ),
    Flag(
        "--compile-fullgraph",
        "compile_fullgraph",
        COMPILE,
        "torch.compile(fullgraph=True): a graph break is an error",
        boolean,
        "BOOL",
        const=True,
    ),
    Flag(
        "--compile-backend",
        "compile_backend",
        COMPILE,
        "inductor (default) | aot_eager (Dynamo and AOTAutograd, no code generation) | eager (Dynamo alone)",
        str,
        "NAME",
    ),
)
