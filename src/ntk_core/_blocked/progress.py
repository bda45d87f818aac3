"""Progress bars (over tiles, over Monte Carlo samples): :func:`show_progress` is the one
rule for whether ``progress=None`` (the default everywhere) shows one."""

from __future__ import annotations

import os
import sys
import types

from ntk_core._errors import bad


def in_ci() -> bool:
    """Whether ``CI`` is set to other than "", 0, false, no or off (in any case)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no", "off")


def show_progress(progress: bool | None, stream=None) -> bool:
    """Whether to show a bar on ``stream`` (default stderr): ``True``/``False`` always/never;
    ``None`` never under :func:`in_ci`, else in Jupyter or when ``stream`` is a terminal and
    ``TERM`` is not ``dumb`` (so no bar goes into logs, pipes, files or captured output)."""
    if progress is not None:
        return bool(progress)
    if in_ci():
        return False
    if _in_jupyter():  # a person watches the notebook; tqdm.auto draws a widget there
        return True
    try:
        terminal = bool((sys.stderr if stream is None else stream).isatty())
    except (AttributeError, ValueError, OSError):  # no stderr (pythonw), a closed stream
        terminal = False
    return terminal and os.environ.get("TERM") != "dumb"


def _in_jupyter() -> bool:
    ipython = sys.modules.get("IPython")
    try:
        shell = ipython.get_ipython() if ipython is not None else None
    except Exception:  # noqa: BLE001 - any failure means: not in a notebook
        return False
    return shell is not None and hasattr(shell, "kernel")


def _unknown_size_fallback(stream) -> dict:
    """80 x 24 for a terminal of 0 columns or rows (size never set): tqdm would draw nothing."""
    try:
        columns, lines = os.get_terminal_size(stream.fileno())
    except (AttributeError, ValueError, OSError):  # not a terminal: tqdm decides
        return {}
    return {} if columns > 0 < lines else dict(ncols=(columns or 80) - 1, nrows=(lines or 24) - 1)


def progress_bar(fn_name: str, progress: bool | None, total: int, unit: str = "it"):
    """A tqdm bar labelled ``fn_name`` of ``total`` ``unit`` on stderr, or None when
    :func:`show_progress` says no (or tqdm is missing and ``progress`` is not ``True``)."""
    if not show_progress(progress):
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        if progress:
            raise bad(
                ImportError, fn_name, "progress=True needs tqdm", "pip install tqdm"
            ) from None
        return None
    return tqdm(total=total, desc=fn_name, unit=unit, **_unknown_size_fallback(sys.stderr))


NO_BAR = types.SimpleNamespace(update=lambda k=1: None, close=lambda: None)  # none shown
NO_BAR.set_description = lambda desc: None
