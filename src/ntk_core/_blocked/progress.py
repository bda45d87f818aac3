"""The progress bars of the blocked engine (over tiles) and of the Monte Carlo kernels
(over samples): when to show one, and the tqdm bar itself.

``progress=None`` (the default everywhere) shows a bar where a person watches a
terminal, and nowhere else: :func:`show_progress` is the one rule.
"""

from __future__ import annotations

import os
import sys

from ntk_core._errors import bad

#: Values of the environment variable ``CI`` that do not mean "running in CI" (any case).
_NOT_CI = ("", "0", "false", "no", "off")


def in_ci() -> bool:
    """Whether the environment variable ``CI`` is set to a true-ish value (CI services
    set ``CI=true``; ``""``, ``0``, ``false``, ``no`` and ``off`` count as unset)."""
    return os.environ.get("CI", "").strip().lower() not in _NOT_CI


def show_progress(progress: bool | None, stream=None) -> bool:
    """Whether to show a progress bar on ``stream`` (default ``sys.stderr``, where tqdm
    writes it).

    ``True`` / ``False``: always / never. ``None`` (the default): never when the
    environment variable ``CI`` is set to a true-ish value (anything but ``""``, ``0``,
    ``false``, ``no``, ``off``; CI services set ``CI=true``, and some run the job in a
    pseudo-terminal); otherwise in a Jupyter kernel (tqdm.auto's notebook bar), or when
    ``stream`` is a terminal (``isatty()``) and ``TERM`` is not ``dumb``. So no bar goes
    into logs, pipes, files, CI output or captured test output.
    """
    if progress is not None:
        return bool(progress)
    if in_ci():
        return False
    if _in_jupyter():  # a person watches the notebook; tqdm.auto draws a widget there
        return True
    stream = sys.stderr if stream is None else stream
    try:
        terminal = bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no stderr (pythonw), a closed stream
        terminal = False
    return terminal and os.environ.get("TERM") != "dumb"


def _in_jupyter() -> bool:
    """Whether this process is a Jupyter (IPython) kernel, whose stderr is no terminal."""
    ipython = sys.modules.get("IPython")
    try:
        shell = ipython.get_ipython() if ipython is not None else None
    except Exception:  # noqa: BLE001 - any failure means: not in a notebook
        return False
    return shell is not None and hasattr(shell, "kernel")


def _unknown_size_fallback(stream) -> dict:
    """tqdm keyword arguments for a terminal that reports a size of 0 columns or rows
    (a pseudo-terminal whose window size was never set, as ``os.openpty``, some
    container runtimes and test harnesses leave it): tqdm takes ``size - 1`` as its
    width and height, -1, and then draws nothing at all, not even with
    ``progress=True``. Then 80 x 24 is assumed, as ``shutil.get_terminal_size`` does."""
    try:
        columns, lines = os.get_terminal_size(stream.fileno())
    except (AttributeError, ValueError, OSError):  # not a terminal: tqdm decides
        return {}
    if columns > 0 and lines > 0:
        return {}
    return {"ncols": (columns or 80) - 1, "nrows": (lines or 24) - 1}


def progress_bar(fn_name: str, progress: bool | None, total: int, unit: str = "it"):
    """A tqdm bar of ``total`` steps on stderr (advance with ``.update(k)``, end with
    ``.close()``), or None when :func:`show_progress` says no (or tqdm is missing and
    ``progress`` is not ``True``). The bar is labelled ``fn_name`` and counts ``unit``."""
    if not show_progress(progress):
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        if progress:
            what = "progress=True needs tqdm, which is not installed"
            raise bad(ImportError, fn_name, what, "pip install tqdm") from None
        return None
    return tqdm(total=total, desc=fn_name, unit=unit, **_unknown_size_fallback(sys.stderr))
