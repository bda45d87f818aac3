"""The guides in ``docs/*.md`` run as a user copies them: each page's ```python blocks,
in order, in one namespace of their own, in a temporary working folder (the files a page
writes land there).

A block that cannot run here (several processes, a cluster, an excerpt of the library's
source) opts out with a visible marker on the line above it,
``<!-- guide: skip (the reason) -->``, and is reported as a skipped test with that
reason; the page's other blocks still run. A page whose blocks import a framework that is
not installed (CI's core-only step has neither flax nor haiku) is skipped, naming it.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import pathlib
import re

import numpy as np
import pytest

import frameworks
import reference
from ntk_core import testing

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"

#: a ```python block, with the guide marker on the line(s) above it if there is one
BLOCK = re.compile(
    r"(?:<!--\s*guide:(?P<marker>[^>]*?)-->[ \t]*\n(?:[ \t]*\n)*)?^```python[ \t]*\n(?P<code>.*?)^```",
    re.S | re.M,
)
SKIP = re.compile(r"\s*skip \((?P<reason>.+)\)\s*")
#: what an import needs installed, where that is not the module itself: an adapter imports
#: its framework; orbax is a namespace package (nothing to find without orbax-checkpoint)
NEEDS = {
    "ntk_flax": "flax",
    "ntk_haiku": "haiku",
    "ntk_equinox": "equinox",
    "orbax": "orbax.checkpoint",
}


class Block:
    def __init__(self, page: pathlib.Path, match: re.Match):
        self.page = page
        self.code = match["code"]
        self.line = page.read_text()[: match.start("code")].count("\n") + 1
        self.reason = None
        if match["marker"] is not None:
            skip = SKIP.fullmatch(match["marker"])
            if skip is None:
                raise ValueError(
                    f"{page.name}:{self.line - 1}: guide marker {match['marker']!r}: "
                    "expected 'skip (the reason)'"
                )
            self.reason = skip["reason"]

    def __repr__(self) -> str:
        return f"{self.page.name}:{self.line}"


def blocks(page: pathlib.Path) -> list[Block]:
    return [Block(page, m) for m in BLOCK.finditer(page.read_text())]


PAGES = sorted(DOCS.glob("*.md"))
RUN = [p for p in PAGES if any(b.reason is None for b in blocks(p))]
SKIPPED = [b for p in PAGES for b in blocks(p) if b.reason is not None]


def _missing(code: str) -> list[str]:
    """The packages that ``code``'s imports need and this environment lacks."""
    imported = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            imported.add(node.module.split(".")[0])
    needed = {NEEDS.get(module, module) for module in imported}
    return sorted(name for name in needed if not _installed(name))


def _installed(name: str) -> bool:
    if "." not in name:
        return frameworks.installed(name)
    try:  # a submodule: its parent is imported to find it
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _check_errors(ns):
    """The equinox BatchNorm recipe's kernel is the float64 reference's."""
    expected = reference.ntk(ns["apply_fn"], ns["params"], ns["x"], ns["x"], trace_axes=())[0]
    reference.assert_close(ns["k"], expected)


def _check_linearize(ns):
    """SGD on f_lin ends where gradient flow does: O(lr), far inside the first residual."""
    start = np.abs(np.asarray(ns["apply_fn"](ns["params0"], ns["x_train"]) - ns["y_train"]))
    assert np.abs(np.asarray(ns["f_sgd"] - ns["f_flow"])).max() < 1e-2 * start.max()


def _check_spectra(ns):
    """The matrix-free top eigenvalues are those of the formed float64 kernel."""
    full = reference.full_ntk(ns["apply_fn"], ns["params"], ns["x"], None)[0]  # (N, O, N, O)
    m = full.shape[0] * full.shape[1]
    expected = np.linalg.eigvalsh(full.reshape(m, m))[::-1][:20]
    np.testing.assert_allclose(ns["top"].eigenvalues, expected, rtol=0, atol=1e-5 * expected[0])


#: after a page has run: its results against an independent reference
CHECKS = {
    "errors.md": _check_errors,
    "linearize.md": _check_linearize,
    "spectra-and-tracking.md": _check_spectra,
}


def test_every_python_block_is_found():
    """The pattern sees every fence and every marker: a block it missed would go untested,
    a marker it missed (not on the line above a block) would skip nothing."""
    for page in PAGES:
        text = page.read_text()
        assert len(blocks(page)) == len(re.findall(r"^```python", text, re.M)), page.name
        markers = len(re.findall(r"^<!--\s*guide:", text, re.M))
        assert sum(b.reason is not None for b in blocks(page)) == markers, page.name
    assert len(RUN) >= 8 and sum(len(blocks(p)) for p in PAGES) >= 25


@pytest.mark.parametrize("page", RUN, ids=lambda p: p.name)
def test_guide_runs_in_order(page, tmp_path, monkeypatch):
    runnable = [b for b in blocks(page) if b.reason is None]
    missing = _missing("\n".join(b.code for b in runnable))
    if missing:
        pytest.skip(f"{page.name} needs {', '.join(missing)} (not installed)")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"guide_{page.stem.replace('-', '_')}"}
    for block in runnable:
        # Tracebacks give the page's own line numbers: blank lines up to the block's first.
        code = compile("\n" * (block.line - 1) + block.code, f"docs/{page.name}", "exec")
        try:
            exec(code, namespace)  # noqa: S102 - the project's own guides
        except Exception as error:
            if hasattr(error, "add_note"):  # Python 3.11
                error.add_note(
                    f"in the block of docs/{page.name} at line {block.line}:\n{block.code}"
                )
            raise
    # A test a page defines runs as under pytest with `--ntk-implementation structured`:
    # the plugin's fixtures are ntk_core.testing's functions of the same names (every
    # implementation is checked by tests/cross_framework/test_user_checks.py).
    fixtures = {
        "assert_kernels_close": testing.assert_kernels_close,
        "assert_same_ntk": functools.partial(testing.assert_same_ntk, implementation="structured"),
    }
    for name, fn in list(namespace.items()):
        if name.startswith("test_") and callable(fn):
            fn(**{arg: fixtures[arg] for arg in inspect.signature(fn).parameters})
    if page.name in CHECKS:
        CHECKS[page.name](namespace)


@pytest.mark.parametrize("block", SKIPPED, ids=repr)
def test_opted_out_block(block):
    pytest.skip(f"{block!r}: {block.reason}")
