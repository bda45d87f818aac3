"""The blocked Gram engine (``batch_size=``) against the one-call kernel and the float64
reference: every implementation x axes setting x (x2 given or None) with sizes that do
not divide the batch size, exact symmetry, feature reuse, bounded features, output
types, progress, non-finite inputs and kernels, and the option errors."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import select
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import core_zoo
import frameworks
import ntk_core
import reference
from ntk_core._blocked import progress as _progress
from ntk_core._blocked import tiles as _blocked

AXES = {
    "trace": dict(trace_axes=(-1,)),
    "full": dict(trace_axes=()),
    "diag_out": dict(trace_axes=(), diagonal_axes=(-1,)),
    "diag_batch": dict(trace_axes=(), diagonal_axes=(0,)),
}
N1, N2, B = 37, 23, 8
ENTRY = core_zoo.ZOO["mlp"]  # Dense 5 -> 8 -> relu -> 3, biases
F = core_zoo.apply_fn(ENTRY)
PARAMS = ENTRY.params
X1 = ENTRY.make_x(jax.random.PRNGKey(11), N1)
X2 = ENTRY.make_x(jax.random.PRNGKey(12), N2)
X2_DIAG = ENTRY.make_x(jax.random.PRNGKey(13), N1)  # the batch diagonal needs N2 = N1


def _swap(k, axes):
    """Θ(x2, x1) from Θ(x1, x2): the x1 and x2 axis of each pair swapped."""
    perm = {"trace": (1, 0), "full": (1, 0, 3, 2), "diag_out": (1, 0, 2)}[axes]
    return np.transpose(k, perm)


@functools.cache
def _kernel(kind, implementation, axes, batch_size, **options):
    """One jitted kernel function per setting, reused by every test that needs it."""
    if kind == "nngp":
        return ntk_core.nngp_fn(F, batch_size=batch_size, progress=False, **AXES[axes], **options)
    make = ntk_core.ntk_fn if kind == "ntk" else ntk_core.ntk_per_leaf_fn
    return make(
        F,
        implementation=implementation,
        batch_size=batch_size,
        progress=False,
        **AXES[axes],
        **options,
    )


def _x2(axes, with_x2):
    if not with_x2:
        return None
    return X2_DIAG if axes == "diag_batch" else X2


def _assert_blocked_equals_one_call(blocked, one_call):
    leaves_b, leaves_o = jax.tree.leaves(blocked), jax.tree.leaves(one_call)
    assert len(leaves_b) == len(leaves_o)
    for b, o in zip(leaves_b, leaves_o, strict=True):
        assert isinstance(b, np.ndarray)  # host output by default
        o = np.asarray(o)
        assert b.shape == o.shape and b.dtype == o.dtype
        scale = np.abs(o).max()
        assert scale > 0
        assert np.abs(b - o).max() <= 1e-5 * scale


@pytest.mark.parametrize("with_x2", [False, True], ids=["x2_none", "x2_given"])
@pytest.mark.parametrize("axes", list(AXES))
@pytest.mark.parametrize("implementation", ["jacobian", "ntvp", "structured", "auto"])
def test_ntk_blocked_equals_one_call(implementation, axes, with_x2):
    x2 = _x2(axes, with_x2)
    blocked = _kernel("ntk", implementation, axes, B)(PARAMS, X1, x2)
    one_call = _kernel("ntk", implementation, axes, None)(PARAMS, X1, x2)
    _assert_blocked_equals_one_call(blocked, one_call)
    if not with_x2 and axes != "diag_batch":
        assert np.array_equal(blocked, _swap(blocked, axes))  # exactly symmetric


@pytest.mark.parametrize("with_x2", [False, True], ids=["x2_none", "x2_given"])
@pytest.mark.parametrize("axes", list(AXES))
def test_nngp_blocked_equals_one_call(axes, with_x2):
    x2 = _x2(axes, with_x2)
    blocked = _kernel("nngp", None, axes, B)(PARAMS, X1, x2)
    _assert_blocked_equals_one_call(blocked, _kernel("nngp", None, axes, None)(PARAMS, X1, x2))
    if not with_x2 and axes != "diag_batch":
        assert np.array_equal(blocked, _swap(blocked, axes))


@pytest.mark.parametrize("axes", ["trace", "diag_batch"])
@pytest.mark.parametrize("implementation", ["jacobian", "structured"])
def test_per_leaf_blocked_equals_one_call(implementation, axes):
    for x2 in (None, _x2(axes, True)):
        blocked = _kernel("per_leaf", implementation, axes, B)(PARAMS, X1, x2)
        one_call = _kernel("per_leaf", implementation, axes, None)(PARAMS, X1, x2)
        assert jax.tree.structure(blocked) == jax.tree.structure(one_call)
        _assert_blocked_equals_one_call(blocked, one_call)


@pytest.mark.parametrize("axes", ["full", "diag_out"])
def test_symmetric_gram_in_triangular_blocks(monkeypatch, axes):
    """x2=None contracts only the sample blocks on and above the diagonal (k = 4 here,
    blocks of 9, 9, 9 and 10 samples) and mirrors the rest: equal to the float64
    reference, and exactly symmetric, one call and blocked (one diagonal tile)."""
    from ntk_core._impl import phases as _implementations

    monkeypatch.setattr(_implementations, "TRIANGLE_MIN_BLOCK", 9)
    monkeypatch.setattr(_implementations, "TRIANGLE_MIN_PAIR_BYTES", 0)
    ref = reference.ntk(F, PARAMS, X1, None, **AXES[axes])[0]
    for implementation, batch_size in [
        ("jacobian", None),
        ("structured", None),
        ("structured", N1),
    ]:
        fn = ntk_core.ntk_fn(
            F,
            implementation=implementation,
            batch_size=batch_size,
            progress=False,
            **AXES[axes],
        )
        assert fn.plan(PARAMS, X1).implementation == implementation
        k = fn(PARAMS, X1)
        reference.assert_close(k, ref)
        assert np.array_equal(k, _swap(k, axes))
    nngp = ntk_core.nngp_fn(F, **AXES[axes])(PARAMS, X1)
    reference.assert_close(nngp, reference.nngp(F, PARAMS, X1, None, **AXES[axes])[0])
    counted = []
    real = _implementations._triangular
    monkeypatch.setattr(
        _implementations, "_triangular", lambda *a: counted.append(a[2]) or real(*a)
    )
    ntk_core.ntk_fn(F, implementation="structured", **AXES[axes])(PARAMS, X1[:36])
    assert counted == [4]  # the path above really was the triangular one


@pytest.mark.parametrize("axes", ["full", "diag_out"])
def test_triangular_blocks_on_the_diagonal_are_made_symmetric(monkeypatch, axes):
    """The triangular contraction has no mirror program after it: each diagonal block is
    made exactly symmetric in its loop. A contraction whose blocks come out asymmetric
    (here by construction: XLA's CPU products happen to give symmetric ones, a TPU's need
    not) still gives an exactly symmetric kernel."""
    from ntk_core._impl import phases as _implementations
    from ntk_core._impl.registry import PHASES

    monkeypatch.setattr(_implementations, "TRIANGLE_MIN_BLOCK", 9)
    monkeypatch.setattr(_implementations, "TRIANGLE_MIN_PAIR_BYTES", 0)
    impl = PHASES["structured"]

    def lopsided(fa, fb, *, config):  # + 1e-3 · (row within the block): asymmetric
        out = impl.contract(fa, fb, config=config)
        rows = lambda k: jnp.arange(k.shape[0], dtype=k.dtype).reshape((-1,) + (1,) * (k.ndim - 1))  # noqa: E731
        return jax.tree.map(lambda k: k + 1e-3 * rows(k), out)

    monkeypatch.setitem(PHASES, "structured", impl._replace(contract=lopsided))

    def g(p, x):  # a function of its own: no program of another test is reused, or kept
        return F(p, x)

    k = np.asarray(ntk_core.ntk_fn(g, implementation="structured", **AXES[axes])(PARAMS, X1))
    assert np.array_equal(k, _swap(k, axes))
    ref = reference.ntk(F, PARAMS, X1, None, **AXES[axes])[0]
    assert 0 < np.abs(k - ref).max() <= 1e-3 * 10  # the perturbation is in it, halved


def test_float64_gram_matrices_of_several_leaves_in_triangular_blocks(monkeypatch):
    """Float64, per-leaf kernels of a model with two output leaves of different ranks,
    traced and ``trace_axes=()``: each leaf exactly symmetric, their sum per output equal
    to the float64 reference. Found by a helper: with the diagonal blocks averaged inside the
    contraction's loop, XLA CPU computed a block's entry one way for (i, j) and another for
    (j, i) (9e-16 asymmetric); 4-D kernels raised a TypeError (int64 indices beside the
    int32 block starts under x64); and kernel leaves of different ranks a ValueError (the
    index tuple was sized by the first leaf)."""
    from ntk_core._impl import phases as _implementations

    monkeypatch.setattr(_implementations, "TRIANGLE_MIN_BLOCK", 9)
    monkeypatch.setattr(_implementations, "TRIANGLE_MIN_PAIR_BYTES", 0)

    def f(p, x):
        z = jnp.tanh(x @ p["w"] + p["b"])
        return {"a": z @ p["va"], "b": (jnp.sin(z) @ p["vb"])[..., None]}  # (N, 3), (N, 2, 1)

    def swap(k):  # neural-tangents' layout: (N1, N2, O1, O1', O2, O2', ...), pairs swapped
        return np.transpose(k, [i + 1 - 2 * (i % 2) for i in range(k.ndim)])

    with jax.enable_x64(True):
        rng = np.random.default_rng(3)
        shapes = {"w": (6, 16), "b": (16,), "va": (16, 3), "vb": (16, 2)}
        params = {k: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0])) for k, s in shapes.items()}
        x = jnp.asarray(rng.standard_normal((N1, 6)))
        for axes in ((-1,), ()):
            per_leaf = ntk_core.ntk_per_leaf_fn(f, trace_axes=axes, implementation="structured")
            found = per_leaf(params, x)
            for k in jax.tree.leaves(found):
                k = np.asarray(k)
                assert k.dtype == np.float64
                assert np.array_equal(k, swap(k))
            refs = reference.ntk(f, params, x, None, trace_axes=axes)
            for out, ref in zip(("a", "b"), refs, strict=True):
                total = sum(np.asarray(found[leaf][out]) for leaf in shapes)
                reference.assert_close(total, ref, dtype="float64")


def test_large_contractions_run_over_blocks_of_x1s_samples(monkeypatch):
    """A contraction whose kernel-sized temporaries pass CONTRACT_TEMP_BYTES runs over
    blocks of x1's samples (x2 given, or a Gram matrix not cut into triangles): equal to
    the float64 reference, and on XLA CPU the compiled tile's temporaries shrink."""
    from ntk_core._impl import phases as _implementations

    monkeypatch.setattr(_implementations, "TRIANGLE_MIN_BLOCK", 9)
    monkeypatch.setattr(_implementations, "ROW_BLOCK_PLATFORMS", (jax.default_backend(),))
    counted = []
    real = _implementations._in_row_blocks
    monkeypatch.setattr(
        _implementations, "_in_row_blocks", lambda *a: counted.append(a[3]) or real(*a)
    )
    for limit in (0, 2**40):  # blocks of at least 9 samples; then in one piece
        monkeypatch.setattr(_implementations, "CONTRACT_TEMP_BYTES", limit)
        for implementation, axes, x2 in [
            ("structured", "full", X2),
            ("jacobian", "trace", X2),
            ("structured", "trace", None),
        ]:
            ntk_core.clear_caches()
            fn = ntk_core.ntk_fn(F, implementation=implementation, **AXES[axes])
            k = fn(PARAMS, X1, x2)
            reference.assert_close(k, reference.ntk(F, PARAMS, X1, x2, **AXES[axes])[0])
    assert counted == [N1 // 9] * 3  # x1's 37 samples in 4 blocks, then none

    def temporaries(limit):
        monkeypatch.setattr(_implementations, "CONTRACT_TEMP_BYTES", limit)
        ntk_core.clear_caches()
        fn = jax.jit(ntk_core.ntk_fn(F, implementation="structured", trace_axes=()))
        return fn.lower(PARAMS, X1, X2).compile().memory_analysis().temp_size_in_bytes

    if jax.default_backend() == "cpu":  # XLA TPU fuses the terms: no temporaries to save
        kernel_bytes = N1 * N2 * 3 * 3 * 4
        assert temporaries(0) < temporaries(2**40) - kernel_bytes


def test_blocked_matches_float64_reference():
    k = _kernel("ntk", "structured", "full", B)(PARAMS, X1, X2)
    reference.assert_close(k, reference.ntk(F, PARAMS, X1, X2, trace_axes=())[0])


def test_pytree_inputs_and_outputs():
    entry = core_zoo.ZOO["dict_input"]
    f, params = core_zoo.apply_fn(entry), entry.params
    x1, _ = core_zoo.inputs(entry, 19, 2)
    blocked = ntk_core.empirical_ntk(f, params, x1, trace_axes=(), batch_size=4)
    expected = reference.ntk(f, params, x1, None, trace_axes=())
    assert isinstance(blocked, tuple) and len(blocked) == 2  # the output's structure
    for a, e in zip(blocked, expected, strict=True):
        reference.assert_close(a, e)


def test_params_by_keyword_and_apply_arguments_closed_over():
    entry = core_zoo.ZOO["batchnorm_eval"]  # running statistics closed over, held fixed
    x1, x2 = core_zoo.inputs(entry, 11, 6)
    kernel = ntk_core.ntk_fn(core_zoo.apply_fn(entry), batch_size=4, progress=False)
    k = kernel(params=entry.params, x1=x1, x2=x2)
    reference.assert_close(k, reference.ntk(core_zoo.apply_fn(entry), entry.params, x1, x2)[0])


@frameworks.requires("flax")
def test_flax_adapter_batched_equals_core_batched():
    """ntk_flax.kernel with batch_size (the model's apply_kwargs and batch_stats held by
    the adapter) gives the kernel of ntk_core.ntk_fn on the closed-over apply function."""
    import ntk_flax
    import zoo

    entry = zoo.ZOO["batchnorm_eval"]  # apply_kwargs {"train": False}, batch_stats fixed
    x1, x2 = zoo.inputs(entry, 11, 6)
    kernel = ntk_core.ntk_fn(zoo.apply_fn(entry), batch_size=4, progress=False)
    k = kernel(params=entry.variables["params"], x1=x1, x2=x2)
    reference.assert_close(
        k, reference.ntk(zoo.apply_fn(entry), entry.variables["params"], x1, x2)[0]
    )
    k_flax = ntk_flax.kernel(
        entry.model, entry.variables, x1, x2, apply_kwargs={"train": False}, batch_size=4
    )
    # Bit-equal on JAX 0.10.2; JAX 0.4.35 rounds a few entries 1 ulp apart (closed-over
    # batch statistics are constant-folded, passed ones are not).
    np.testing.assert_allclose(k_flax, k, rtol=1e-6, atol=0)


def test_vmap_axes_none_blocks_are_batches():
    kernel = _kernel("ntk", "jacobian", "trace", B, vmap_axes=None)
    one_call = _kernel("ntk", "jacobian", "trace", None, vmap_axes=None)
    _assert_blocked_equals_one_call(kernel(PARAMS, X1, X2), one_call(PARAMS, X1, X2))


def test_vmap_axes_none_refused_when_samples_interact():
    def f(w, x):  # a batch mean: sample outputs depend on the whole batch
        h = x @ w
        return h - h.mean(axis=0)

    w, x = jnp.ones((5, 2)), X1
    assert ntk_core.empirical_ntk(f, w, x, vmap_axes=None, batch_size=N1).shape == (N1, N1)
    with pytest.raises(ValueError, match=r"empirical_ntk: batch_size=8 with vmap_axes=None"):
        ntk_core.empirical_ntk(f, w, x, vmap_axes=None, batch_size=8)


def test_lenet_c1_same_gram_for_every_batch_size():
    entry = core_zoo.ZOO["lenet"]  # ntk_flax.LeNet() in plain JAX: one output
    f, params = core_zoo.apply_fn(entry), entry.params
    x = jax.random.normal(jax.random.PRNGKey(0), (120, 32, 32, 3))
    one_call = np.asarray(ntk_core.empirical_ntk(f, params, x, trace_axes=()))
    assert one_call.shape == (120, 120, 1, 1)
    for batch_size in (500, 100, 10):  # 500 >= N: one tile
        k = ntk_core.empirical_ntk(f, params, x, trace_axes=(), batch_size=batch_size)
        _assert_blocked_equals_one_call(k, one_call)
        assert np.array_equal(k, _swap(k, "full"))


def _counted(kernel):
    """Counts the feature computations of a kernel function of ``ntk_fn``."""
    engine = kernel._engine
    calls = []
    original = engine.implementation

    def implementation(config):
        found = original(config)

        def counted(params, x, aux):
            if not isinstance(jax.tree.leaves(x)[0], jax.core.Tracer):  # not eval_shape
                calls.append(jax.tree.leaves(x)[0].shape[0])
            return found.features(params, x, aux)

        return dataclasses.replace(found, features=counted)

    engine.implementation = implementation
    return calls


def test_features_computed_once_per_block():
    kernel = ntk_core.ntk_fn(F, implementation="structured", batch_size=B, progress=False)
    calls = _counted(kernel)
    expected = kernel(PARAMS, X1, X2)
    assert len(calls) == 5 + 3  # ceil(37 / 8) row blocks, ceil(23 / 8) column blocks
    calls.clear()
    symmetric = kernel(PARAMS, X1)
    assert len(calls) == 5
    reference.assert_close(symmetric, reference.ntk(F, PARAMS, X1, None)[0])
    reference.assert_close(expected, reference.ntk(F, PARAMS, X1, X2)[0])


def test_features_bounded_by_memory_budget():
    # Room for the tile and two blocks of features: bands of one column block, the
    # row features recomputed once per band (3 bands).
    loose = ntk_core.ntk_fn(F, implementation="jacobian", batch_size=B, progress=False)
    engine = loose._engine
    features = engine.implementation(engine.prepare(PARAMS, X1, X2)[1]).features
    block = jax.eval_shape(features, PARAMS, X1[:B], None)
    block_bytes = sum(v.size * v.dtype.itemsize for v in jax.tree.leaves(block))
    tight = ntk_core.ntk_fn(
        F,
        implementation="jacobian",
        batch_size=B,
        progress=False,
        memory_budget=int(2.5 * block_bytes) + 2 * 8 * B * B * 4,
    )
    calls = _counted(tight)
    k = tight(PARAMS, X1, X2)
    assert len(calls) == 3 + 3 * 5
    np.testing.assert_array_equal(k, loose(PARAMS, X1, X2))
    calls.clear()
    np.testing.assert_array_equal(tight(PARAMS, X1), loose(PARAMS, X1))


def test_auto_batch_size_rule_and_result():
    f_bytes, w_bytes, budget = 1000, 24, 10**6
    n = 10**5
    b = _blocked.auto_batch_size(n, n, f_bytes, w_bytes, budget, False)
    assert 2 * f_bytes * b + w_bytes * b * b <= budget
    largest = b
    while 2 * f_bytes * (largest + 1) + w_bytes * (largest + 1) ** 2 <= budget:
        largest += 1
    assert -(-n // b) == -(-n // largest)  # as few blocks as the largest fitting size
    assert _blocked.auto_batch_size(100, 100, 0, 1, 60**2, False) == 50  # 2 even blocks
    assert _blocked.auto_batch_size(50, 40, f_bytes, w_bytes, 10**12, False) == 50
    assert _blocked.auto_batch_size(10**5, 10**5, 0, 10, 1000, True) == 100
    assert _blocked.auto_batch_size(10**5, 10**5, 10**9, 10, 1000, False) == 1
    small = ntk_core.ntk_fn(F, batch_size="auto", memory_budget=20_000, progress=False)
    _assert_blocked_equals_one_call(
        small(PARAMS, X1, X2), _kernel("ntk", "auto", "trace", None)(PARAMS, X1, X2)
    )


def test_output_types():
    one_call = _kernel("ntk", "structured", "trace", None)(PARAMS, X1)
    assert isinstance(one_call, jax.Array)  # batch_size=None: today's behaviour
    host = _kernel("ntk", "structured", "trace", B)(PARAMS, X1)
    assert isinstance(host, np.ndarray)
    device = ntk_core.empirical_ntk(
        F, PARAMS, X1, implementation="structured", batch_size=B, store_on_device=True
    )
    assert isinstance(device, jax.Array)
    np.testing.assert_array_equal(np.asarray(device), host)


def test_progress_bar_on_and_off(capsys):
    ntk_core.empirical_ntk(F, PARAMS, X1, X2, batch_size=B, progress=True)
    err = capsys.readouterr().err
    assert "15/15" in err and "tile" in err  # 5 x 3 tiles
    ntk_core.empirical_ntk(F, PARAMS, X1, X2, batch_size=B, progress=False)
    ntk_core.empirical_ntk(F, PARAMS, X1, X2, batch_size=B)  # None: stderr is no terminal
    assert capsys.readouterr().err == ""


# A blocked kernel of 4 x 4 tiles with the default progress=None, once per environment
# of argv[1] (a JSON list of {name: value or None (unset)}, applied on top of the last;
# the rule reads the environment at each call): "done" on stdout after each, and a
# marker line on stderr between them.
_PROGRESS_SCRIPT = """
import json, os, sys
import jax.numpy as jnp
import ntk_core
for i, environ in enumerate(json.loads(sys.argv[1])):
    for name, value in environ.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if i:
        print(MARKER, file=sys.stderr, flush=True)
    k = ntk_core.empirical_ntk(lambda w, x: jnp.tanh(x @ w), jnp.ones((3, 2)),
                               jnp.ones((16, 3)), jnp.ones((16, 3)), batch_size=4)
    print("done", k.shape, file=sys.stdout, flush=True)
"""
_MARKER = "@@ next environment @@"
_PROGRESS_SCRIPT = f"MARKER = {_MARKER!r}\n" + _PROGRESS_SCRIPT


def _stderr_of_default_progress(terminal_size, *environs):
    """What the blocked engine with ``progress=None`` writes to stderr, one string per
    environment of ``environs`` (default: one, unchanged), in one subprocess whose
    stderr is a pipe (``terminal_size=None``) or a pseudo-terminal (``os.openpty``) of
    ``terminal_size`` (rows, columns); (0, 0) is a window size never set, as harnesses
    and some container runtimes leave it. Each environment (None: unset) is applied on
    top of the one before, starting from this environment without ``CI`` and tqdm
    settings, with ``TERM=xterm``."""
    env = {k: v for k, v in os.environ.items() if k != "CI" and not k.startswith("TQDM_")}
    env["TERM"] = "xterm"
    environs = list(environs) or [{}]
    command = [sys.executable, "-c", _PROGRESS_SCRIPT, json.dumps(environs)]
    done = "done (16, 16)\n" * len(environs)
    if terminal_size is None:
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 0 and result.stdout == done, result.stderr
        return _split(result.stderr, len(environs))
    import fcntl  # POSIX only
    import termios

    parent, child = os.openpty()
    try:
        fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", *terminal_size, 0, 0))
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=child, env=env
        )
    finally:
        os.close(child)
    written = b""
    try:
        while True:  # until the child's end of the terminal is closed (EOF, or EIO on Linux)
            ready, _, _ = select.select([parent], [], [], 120)
            assert ready, f"no output in 120 s; so far {written!r}"
            try:
                data = os.read(parent, 1 << 16)
            except OSError:
                break
            if not data:
                break
            written += data
        stdout = process.communicate(timeout=120)[0].decode()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(parent)
    assert process.returncode == 0 and stdout.replace("\r", "") == done, written[-3000:]
    return _split(written.decode(errors="replace"), len(environs))


def _split(stderr: str, count: int) -> list[str]:
    parts = stderr.split(_MARKER)
    assert len(parts) == count, stderr[-3000:]
    return parts


_NEEDS_PTY = pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")


@_NEEDS_PTY
def test_default_progress_bar_in_a_terminal_of_unknown_size():
    (err,) = _stderr_of_default_progress((0, 0))
    assert "empirical_ntk" in err and "16/16" in err and "tile" in err, err  # 4 x 4 tiles


@_NEEDS_PTY
def test_default_progress_bar_in_a_terminal_but_not_in_ci_or_a_dumb_terminal():
    """In a 24 x 80 terminal, one process: CI=true, CI=1 and TERM=dumb each turn the
    bar off; with CI unset and TERM=xterm it is drawn (16 tiles: 4 x 4)."""
    environs = [{"CI": "true"}, {"CI": "1"}, {"CI": None, "TERM": "dumb"}, {"TERM": "xterm"}]
    *off, on = _stderr_of_default_progress((24, 80), *environs)
    for environ, err in zip(environs[:-1], off, strict=True):
        assert "tile" not in err and "empirical_ntk" not in err, (environ, err)
    assert "empirical_ntk" in on and "16/16" in on and "tile" in on, on


def test_no_default_progress_bar_into_a_pipe():
    (err,) = _stderr_of_default_progress(None)
    assert "tile" not in err and "empirical_ntk" not in err, err


def test_show_progress_rule(monkeypatch):
    class Terminal:
        def isatty(self):
            return True

    class Closed:
        def isatty(self):
            raise ValueError("I/O operation on closed file")

    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    show = _progress.show_progress
    assert show(None, Terminal()) and not show(None, Closed()) and not show(None, object())
    assert show(True, None) and not show(False, Terminal())
    for value in ("", "0", "false", "False", "no", "off"):
        monkeypatch.setenv("CI", value)
        assert show(None, Terminal()), value
    for value in ("true", "1", "yes", "True"):
        monkeypatch.setenv("CI", value)
        assert not show(None, Terminal()) and show(True, Terminal()), value
    monkeypatch.delenv("CI")
    monkeypatch.setenv("TERM", "dumb")
    assert not show(None, Terminal())
    # a Jupyter kernel (stderr is no terminal there): the notebook bar, except in CI
    kernel_shell = type("Shell", (), {"kernel": object()})()
    ipython = type(sys)("IPython")
    ipython.get_ipython = lambda: kernel_shell
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    assert show(None, object())
    monkeypatch.setenv("CI", "true")
    assert not show(None, object())
    ipython.get_ipython = lambda: None  # IPython imported, but no kernel
    monkeypatch.delenv("CI")
    assert not show(None, object())


def _with(x, i, value):
    x = np.array(x)
    x[i, 1] = value
    return x


@pytest.mark.parametrize("batch_size", [None, B])
def test_nonfinite_inputs_name_argument_and_sample(batch_size):
    with pytest.raises(
        ValueError, match=r"empirical_ntk: x1 contains NaN values, first in sample 5"
    ):
        ntk_core.empirical_ntk(F, PARAMS, _with(X1, 5, np.nan), batch_size=batch_size)
    with pytest.raises(
        ValueError, match=r"empirical_nngp: x2 contains Inf values, first in sample 3"
    ):
        ntk_core.empirical_nngp(
            F, PARAMS, X1, jnp.asarray(_with(X2, 3, np.inf)), batch_size=batch_size
        )


def test_nonfinite_input_leaf_of_a_pytree_is_named():
    entry = core_zoo.ZOO["dict_input"]
    x1, _ = core_zoo.inputs(entry, 6, 2)
    x1 = {**x1, "mask": _with(x1["mask"], 4, np.nan)}
    with pytest.raises(ValueError, match=r"x1\['mask'\] contains NaN values, first in sample 4"):
        ntk_core.empirical_ntk(core_zoo.apply_fn(entry), entry.params, x1)


@pytest.mark.parametrize("batch_size", [None, B])
def test_nonfinite_kernel_from_finite_inputs(batch_size):
    def f(w, x):  # NaN where x @ w < 0
        return jnp.sqrt(x @ w)

    w = jnp.ones((5, 2))
    x = np.abs(np.asarray(X1))
    x[17] *= -1.0
    pattern = (
        r"empirical_ntk: the kernel came out non-finite .* first at x1 sample 0 and x2 sample 17"
    )
    with pytest.raises(ValueError, match=pattern):
        ntk_core.empirical_ntk(f, w, x, x, batch_size=batch_size)
    with pytest.raises(ValueError, match=r"came out non-finite.*Fix:"):
        ntk_core.empirical_ntk(lambda w, x: 1e30 * (x @ w), w, X1, batch_size=batch_size)


ERRORS = [
    (
        dict(batch_size=0),
        ValueError,
        r"batch_size must be a positive number of samples per tile, got 0",
    ),
    (dict(batch_size=-3), ValueError, r"got -3\. Fix: pass e\.g\. batch_size=256"),
    (
        dict(batch_size=True),
        TypeError,
        r"batch_size must be None, a positive int or 'auto', got bool True",
    ),
    (dict(batch_size=2.5), TypeError, r"got float 2\.5\. Fix:"),
    (dict(batch_size="big"), ValueError, r"got the string 'big'\. Fix:"),
    (
        dict(store_on_device="yes"),
        TypeError,
        r"store_on_device must be True or False, got str 'yes'",
    ),
    (dict(progress=1), TypeError, r"progress must be None, True or False, got int 1"),
    (
        dict(memory_budget=0),
        ValueError,
        r"memory_budget must be a positive int number of bytes, got 0",
    ),
    (
        dict(memory_budget=1.5e9),
        TypeError,
        r"memory_budget must be None or a positive int .* got float",
    ),
    (dict(memory_budget=True), TypeError, r"got bool True"),
]


@pytest.mark.parametrize(("options", "exc", "pattern"), ERRORS, ids=[repr(e[0]) for e in ERRORS])
def test_option_errors(options, exc, pattern):
    with pytest.raises(exc, match=r"^empirical_ntk: .*" + pattern):
        ntk_core.empirical_ntk(F, PARAMS, X1, **options)
    with pytest.raises(exc, match=r"^nngp_fn: .*" + pattern):
        ntk_core.nngp_fn(F, **options)


@frameworks.requires("flax")
@pytest.mark.parametrize(("options", "exc", "pattern"), ERRORS, ids=[repr(e[0]) for e in ERRORS])
def test_option_errors_through_the_flax_adapter(options, exc, pattern):
    import flax.linen as nn

    import ntk_flax

    with pytest.raises(exc, match=r"^ntk_flax.kernel_fn: .*" + pattern):
        ntk_flax.kernel_fn(nn.Dense(3), **options)


@pytest.mark.parametrize("batch_size", [B, "auto"])
def test_plan_shows_the_tiles_the_engine_computes(batch_size, monkeypatch):
    """plan() reports the blocks batch_size='auto' picks and the number of tiles; the
    engine computes exactly those tiles (counted), and the auto blocks obey
    2·F·B + W·B² ≤ budget."""
    budget = 60_000
    kernel = ntk_core.ntk_fn(
        F, trace_axes=(), batch_size=batch_size, memory_budget=budget, progress=False
    )
    for x2 in (None, X2):
        cut = kernel.plan(PARAMS, X1, x2).tiling
        n2 = N1 if x2 is None else N2
        k1, k2 = -(-N1 // cut.b1), -(-n2 // cut.b2)
        assert cut.tiles == (k1 * (k1 + 1) // 2 if x2 is None else k1 * k2)
        if batch_size == B:
            assert (cut.b1, cut.b2) == (B, B)
        else:
            b = max(cut.b1, cut.b2)
            assert 2 * cut.feature_bytes * b + cut.pair_bytes * b * b <= budget
            assert b < N1  # the budget really cuts
        assert f"{cut.tiles} tiles" in str(kernel.plan(PARAMS, X1, x2))
        calls = []
        original = _blocked._Output.put

        def put(self, *args, calls=calls, original=original):
            calls.append(1)
            return original(self, *args)

        monkeypatch.setattr(_blocked._Output, "put", put)
        kernel(PARAMS, X1, x2)
        monkeypatch.undo()
        assert len(calls) == cut.tiles


def test_core_plan_takes_the_blocked_options_and_shows_the_tiles():
    """ntk_core.plan accepts batch_size and memory_budget as empirical_ntk does (it
    refused them before, while ntk_flax.plan took them): 40 samples in blocks of 8 are
    5 blocks, 5·6/2 = 15 tiles on and above the diagonal, 5·3 = 15 against 20 others."""
    x = jnp.ones((40, 3))
    p = ntk_core.plan(lambda w, x: jnp.tanh(x @ w), jnp.ones((3, 2)), x, batch_size=8)
    assert (p.tiling.b1, p.tiling.b2, p.tiling.tiles) == (8, 8, 15)
    p = ntk_core.plan(
        lambda w, x: jnp.tanh(x @ w), jnp.ones((3, 2)), x, x[:20], batch_size=8, memory_budget=2**20
    )
    assert (p.tiling.tiles, p.tiling.budget) == (15, 2**20)
    assert "15 tiles" in str(p)


def test_auto_in_the_blocked_engine_ignores_the_one_call_memory(monkeypatch):
    """With a batch_size the tiles bound the device memory whatever the implementation,
    so "auto" takes the fastest even where the one-call estimate (the whole kernel and
    its copy) fits no implementation; in one call it plans the same tiles, kept on the
    device (issue 51; before, it fell back to NTK-vector products). (At N = 30 000 the one-call estimate of the MLP's 3.6 GB kernel fitted nothing, and
    auto chose NTK-vector products for a blocked call.)"""
    from ntk_core._impl import cost as _cost

    monkeypatch.setattr(_cost, "JACOBIAN_MEMORY_BUDGET", 1000)  # bytes: nothing fits
    one_call = ntk_core.ntk_fn(F)
    blocked = ntk_core.ntk_fn(F, batch_size=8, progress=False)
    assert one_call.plan(PARAMS, X1).in_tiles.implementation != "ntvp"
    estimates = blocked.plan(PARAMS, X1).estimates
    fastest = min(estimates, key=lambda e: e.seconds).implementation
    assert fastest != "ntvp" and blocked.implementation_for(PARAMS, X1) == fastest
    reference.assert_close(blocked(PARAMS, X1), reference.ntk(F, PARAMS, X1, None)[0])
