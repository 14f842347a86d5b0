"""torchtitan's own parallelize with its compile config left off, though the case asks for its
compile (`compile: blocks`) and the engine declares it: a config that never reaches
`apply_compile`. Every number agrees (eager and compiled blocks compute the same here); the knobs
check must name the compile that was not applied."""

from dataclasses import replace

from fsdp_verify.frameworks.torchtitan import parallelize


def compile_left_off(model, mesh, spec):
    return parallelize(
        model,
        mesh,
        replace(spec, case=spec.case.with_(compile=None, compile_fullgraph=False, compile_backend="inductor")),
    )


compile_left_off.capabilities = parallelize.capabilities
