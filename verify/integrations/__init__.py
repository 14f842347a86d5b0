"""Where users already train: the Recorder as a transformers `TrainerCallback`
(`fsdp_verify.integrations.trainer`), around an Accelerate loop (`...accelerate`) and as a
Lightning `Callback` (`...lightning`). Nothing here imports a library until its module is
imported: each needs its own extra (`fsdp-verify[hf]`, `[accelerate]`, `[lightning]`)."""


def require(module: str, extra: str):
    """Import `module`, or say which extra brings it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{module} is not installed: pip install 'fsdp-verify[{extra}]' ({e})") from e
