"""The library's own exception types (the rest are ``ValueError`` / ``TypeError``)."""


class NonFiniteError(ValueError):
    """NaN or inf in an input, a kernel, one of its tiles, a Monte Carlo sum or a
    prediction. A ``ValueError``, so ``except ValueError`` still catches it; its own
    type lets a caller (the Monte Carlo kernels, a user's retry loop) tell it from other
    bad input without reading the message."""
