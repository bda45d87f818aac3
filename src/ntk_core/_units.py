"""Quantities in messages."""


def human_bytes(nbytes: float) -> str:
    """``nbytes`` in GiB, MiB, or exact bytes below 1 MiB."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{int(nbytes)} bytes"
