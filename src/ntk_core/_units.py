"""Quantities in messages."""


def human_bytes(nbytes: float) -> str:
    """``nbytes`` for a message: GiB, MiB or KiB (whichever reads best), with the
    exact count below 1 MiB."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{int(nbytes)} bytes"
