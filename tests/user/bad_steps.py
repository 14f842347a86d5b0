"""Steps a user gets wrong: each must be bad input named `step` (exit 2), never a rank failure."""


def bad_sig(model, optimizer):
    return 0.0


def returns_none(model, optimizer, batch, ctx):
    return None


def raises(model, optimizer, batch, ctx):
    raise ValueError("my bug")
