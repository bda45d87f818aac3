"""The static half of the per-sample independence check (``vmap_axes=0``):
:func:`ntk_core._jax.sample_axes.rows_separate` proves from a model's jaxpr that row i of its
outputs reads only row i of x, so no probe program is compiled. Checked against the
models themselves: a proof only where the batch's rows equal the samples evaluated one at
a time, and no proof for any construct that mixes rows."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import core_zoo
import ntk_core
import reference
import zoo
from ntk_core._jax.sample_axes import rows_separate, sized_by_n


def _proved(apply_fn, params, x) -> bool:
    traced = jax.jit(apply_fn).trace(params, x)
    marks = [False] * len(jax.tree.leaves(params)) + [True] * len(jax.tree.leaves(x))
    return rows_separate(traced.jaxpr, marks, jax.tree.leaves(x)[0].shape[0])


def _rows_mix(apply_fn, params, x) -> bool:
    """The reference: whether some output row i changes when only the other rows of x do."""
    apply_fn = jax.jit(apply_fn)
    whole = jax.tree.leaves(apply_fn(params, x))
    n = jax.tree.leaves(x)[0].shape[0]
    for i in range(n):

        def others_changed(v, i=i):
            changed = v[::-1] if jnp.issubdtype(v.dtype, jnp.integer) else 1.7 * v - 0.4
            return v.at[jnp.arange(n) != i].set(changed[jnp.arange(n) != i])

        moved = jax.tree.leaves(apply_fn(params, jax.tree.map(others_changed, x)))
        if any(
            not np.allclose(a[i], b[i], rtol=1e-5, atol=1e-6)
            for a, b in zip(whole, moved, strict=True)
        ):
            return True
    return False


ZOOS = [(core_zoo, name) for name in core_zoo.ZOO] + [(zoo, name) for name in zoo.ZOO]


@pytest.mark.parametrize("source,name", ZOOS, ids=[f"{z.__name__}-{n}" for z, n in ZOOS])
def test_zoo_models_are_proved_and_their_rows_are_separate(source, name):
    entry = source.ZOO[name]
    params = entry.params if source is core_zoo else entry.variables["params"]
    x, _ = source.inputs(entry, 3, 2)
    apply_fn = source.apply_fn(entry)
    assert _proved(apply_fn, params, x)
    assert not _rows_mix(apply_fn, params, x)
    one = jax.jit(apply_fn).trace(params, jax.tree.map(lambda v: v[:1], x)).jaxpr
    whole = jax.jit(apply_fn).trace(params, x).jaxpr
    sized = sized_by_n(whole, one, 3, 1)  # N only the samples' axis: no probe compiled
    marks = [False] * len(jax.tree.leaves(params)) + [True] * len(jax.tree.leaves(x))
    assert sized is not None and rows_separate(whole, marks, 3, sized)


def _dense(w, x):
    return jnp.tanh(x @ w)


MIXING = {
    "batch mean": lambda w, x: _dense(w, x) - _dense(w, x).mean(0),
    "batch max": lambda w, x: _dense(w, x) + _dense(w, x).max(0, keepdims=True),
    "softmax over samples": lambda w, x: jax.nn.softmax(_dense(w, x), axis=0),
    "first sample added": lambda w, x: _dense(w, x) + _dense(w, x)[:1],
    "reversed": lambda w, x: _dense(w, x)[::-1],
    "permuted": lambda w, x: _dense(w, x)[jnp.array([2, 0, 1])],
    "rolled": lambda w, x: jnp.roll(_dense(w, x), 1, 0),
    "cumsum over samples": lambda w, x: jnp.cumsum(_dense(w, x), 0),
    "sorted over samples": lambda w, x: jnp.sort(_dense(w, x), 0),
    "flattened": lambda w, x: _dense(w, x).reshape(-1)[::-1].reshape(3, 4),
    "transposed": lambda w, x: jnp.transpose(_dense(w, x).reshape(3, 2, 2), (1, 0, 2)).reshape(
        3, 4
    ),
    "gram of samples": lambda w, x: (x @ x.T) @ jnp.ones((3, 4)) + _dense(w, x),
    "contracted over samples": lambda w, x: jnp.ones((3, 3)) @ _dense(w, x),
    "padded": lambda w, x: jnp.pad(_dense(w, x), ((1, 0), (0, 0)))[:3],
    "concatenated": lambda w, x: jnp.concatenate([_dense(w, x), _dense(w, x)])[1:4],
    "dynamic slice": lambda w, x: jax.lax.dynamic_slice_in_dim(
        jnp.concatenate([_dense(w, x), _dense(w, x)]), 1, 3, 0
    ),
    "window over samples": lambda w, x: jax.lax.reduce_window(
        _dense(w, x), 0.0, jax.lax.add, (2, 1), (1, 1), "SAME"
    ),
    "scan over samples": lambda w, x: jax.lax.scan(
        lambda c, r: (c + r, c + r), jnp.zeros(4), _dense(w, x)
    )[1],
    "convolution over samples": lambda w, x: (
        jax.lax.conv_general_dilated(
            _dense(w, x).T[None],
            jnp.ones((4, 4, 2)),
            (1,),
            "SAME",
            dimension_numbers=("NCH", "OIH", "NCH"),
        )[0].T
    ),
    "first row broadcast": lambda w, x: jnp.broadcast_to(_dense(w, x)[:1], (3, 4)) + x @ w,
    "mean over samples, transposed": lambda w, x: (
        (_dense(w, x).T - _dense(w, x).T.mean(1, keepdims=True)).T
    ),
    "vmapped, then mixed": lambda w, x: jnp.cumsum(jax.vmap(lambda xi: jnp.tanh(w.T @ xi))(x), 0),
    "gathered at an argmax": lambda w, x: (
        _dense(w, x) + _dense(w, x)[jnp.argmax(_dense(w, x), axis=1) % x.shape[0]]
    ),
    "batch norm (training)": lambda w, x: core_zoo.batch_norm_train(
        {"scale": jnp.ones(4), "bias": jnp.zeros(4)}, x @ w
    ),
}


@pytest.mark.parametrize("name", list(MIXING))
def test_constructs_that_mix_rows_are_not_proved(name):
    w = jax.random.normal(jax.random.PRNGKey(0), (5, 4))
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 5))
    assert _rows_mix(MIXING[name], w, x)  # the construct really mixes rows
    assert not _proved(MIXING[name], w, x)


SEPARATE = {
    "vmapped per-sample model (equinox)": lambda w, x: jax.vmap(lambda xi: jnp.tanh(w.T @ xi))(x),
    "samples moved to axis 1 and back": lambda w, x: (2.0 * _dense(w, x).T).T,
    "attention over a second axis": lambda w, x: jnp.einsum(
        "qbd,kbd->bqk", _dense(w, x).T[:, :, None], _dense(w, x).T[:, :, None]
    ).reshape(3, 16),
    "features reduced, samples kept": lambda w, x: _dense(w, x).sum(1, keepdims=True) * x @ w,
}


@pytest.mark.parametrize("name", list(SEPARATE))
def test_constructs_that_keep_rows_apart_are_proved(name):
    w = jax.random.normal(jax.random.PRNGKey(0), (5, 4))
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 5))
    assert not _rows_mix(SEPARATE[name], w, x)
    assert _proved(SEPARATE[name], w, x)


ANY_N = [
    "gathered at an argmax", "batch mean", "batch max", "softmax over samples", "first sample added", "reversed",
    "rolled", "cumsum over samples", "sorted over samples", "window over samples",
    "scan over samples", "mean over samples, transposed", "vmapped, then mixed",
    "batch norm (training)",
]  # fmt: skip


@pytest.mark.parametrize("name", ANY_N)
def test_kernels_of_models_mixing_any_row_are_refused(name):
    """Where no proof is found, the probe changes every row but one in turn: a model whose
    first row reads only the first sample (a cumulative sum over the batch) is refused too
    (the probe compared the first row only before)."""
    w = jax.random.normal(jax.random.PRNGKey(0), (5, 4))
    x = jax.random.normal(jax.random.PRNGKey(1), (6, 5))
    with pytest.raises(ValueError, match="depends on the other samples"):
        ntk_core.empirical_ntk(MIXING[name], w, x)


def _neighbours(w, xs):
    """A graph layer: each sample adds its neighbour's features (indices given as input)."""
    x, neighbour = xs
    return _dense(w, x) + _dense(w, x)[neighbour]


def _zero_gate(p, x):
    """A cross-sample branch behind a gate initialised at zero: the outputs do not mix,
    their gradient does."""
    return _dense(p["w"], x) + p["g"] * _dense(p["w"], x).mean(0)


@jax.custom_jvp
def _identity_mixing_tangent(h):
    return h


@_identity_mixing_tangent.defjvp
def _(primals, tangents):
    return primals[0], tangents[0] + tangents[0].mean(0)


@jax.custom_vjp
def _identity_mixing_cotangent(h):
    return h


_identity_mixing_cotangent.defvjp(lambda h: (h, None), lambda _, g: (g + g.mean(0),))


GRADIENT_MIXING = {
    "gate at zero": _zero_gate,
    "stop_gradient difference": lambda p, x: (
        _dense(p["w"], x)
        + (_dense(p["w"], x).mean(0) - jax.lax.stop_gradient(_dense(p["w"], x).mean(0)))
    ),
    "custom_jvp rule": lambda p, x: _identity_mixing_tangent(_dense(p["w"], x)),
    "custom_vjp backward pass": lambda p, x: _identity_mixing_cotangent(_dense(p["w"], x)),
}


@pytest.mark.parametrize("name", list(GRADIENT_MIXING))
def test_models_whose_gradients_mix_samples_are_refused(name):
    """Outputs that do not mix while their derivatives do (found by a new user's check):
    the proof and the probe read the model's derivative along a parameter direction too."""
    p = {"w": jax.random.normal(jax.random.PRNGKey(0), (5, 4)), "g": jnp.zeros(())}
    x = jax.random.normal(jax.random.PRNGKey(1), (6, 5))
    assert not _rows_mix(GRADIENT_MIXING[name], p, x)  # the forward pass alone passes
    with pytest.raises(ValueError, match="depends on the other samples"):
        ntk_core.empirical_ntk(GRADIENT_MIXING[name], p, x)


def test_neighbours_given_as_an_input_are_refused():
    w = jax.random.normal(jax.random.PRNGKey(0), (5, 4))
    xs = (jax.random.normal(jax.random.PRNGKey(1), (6, 5)), (jnp.arange(6) + 1) % 6)
    assert _rows_mix(_neighbours, w, xs)
    assert not _proved(_neighbours, w, xs)
    with pytest.raises(ValueError, match="depends on the other samples"):
        ntk_core.empirical_ntk(_neighbours, w, xs)


def _tokens_centred(table, t):
    h = jnp.tanh(table[t].sum(1))
    return h - h.mean(0)


def test_two_samples_of_token_ids_are_checked():
    """Two samples of token ids were not checked (rows changed to a third sample): a
    batch-centred model got a wrong kernel at N = 2, and with vmap_axes=None, batch_size=1
    (found by a helper). Rows now change to values other samples have at the same
    positions (a third row mixing the two), 0 or 1 where all samples agree: equal samples
    and an all-ones mask were accepted, and equal samples cached as independent."""
    table = jax.random.normal(jax.random.PRNGKey(0), (11, 4))
    ids = jax.random.randint(jax.random.PRNGKey(1), (8, 3), 0, 11)
    kernel = ntk_core.ntk_fn(_tokens_centred)
    with pytest.raises(ValueError, match="depends on the other samples"):
        kernel(table, ids[:2])
    with pytest.raises(ValueError, match="splits interacting samples"):
        ntk_core.empirical_ntk(_tokens_centred, table, ids[:2], vmap_axes=None, batch_size=1)
    with pytest.raises(ValueError, match="depends on the other samples"):
        kernel(table, ids[:1])  # one sample: synthetic rows (positions set to 0 or 1)
    with pytest.raises(ValueError, match="depends on the other samples"):
        kernel(table, jnp.tile(ids[:1], (4, 1)))  # equal samples: cached as independent before
    mask = jnp.ones((3, 5), jnp.int32)  # all samples agree at every position

    def by_batch_count(table, x):  # a slip: the whole batch's mask total
        return jnp.tanh(table[x[0]].sum(1) / x[1].sum())

    with pytest.raises(ValueError, match="depends on the other samples"):
        ntk_core.empirical_ntk(by_batch_count, table, (ids[:3, : 5 - 2], mask))

    def tokens(table, t):  # independent: still accepted at N = 2, with its kernel
        return jnp.tanh(table[t].sum(1))

    whole = ntk_core.empirical_ntk(tokens, table, ids[:2], vmap_axes=None)
    np.testing.assert_allclose(ntk_core.empirical_ntk(tokens, table, ids[:2]), whole, rtol=1e-5)


def test_inside_jit_the_proof_holds_and_an_unproved_model_is_warned_about():
    """Inside a user's jax.jit there are no values to probe: a model the jaxpr proves
    independent gives the kernel of a call outside jit, silently; one it does not gets a
    warning (it returned a wrong kernel in silence, found by a new user's check)."""
    w = jax.random.normal(jax.random.PRNGKey(0), (5, 4))
    x = jax.random.normal(jax.random.PRNGKey(1), (6, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        inside = jax.jit(lambda p, x: ntk_core.empirical_ntk(_dense, p, x))(w, x)
    np.testing.assert_allclose(inside, ntk_core.empirical_ntk(_dense, w, x), rtol=1e-5)
    with pytest.warns(UserWarning, match="inside jax.jit or grad the samples' independence"):
        jax.jit(lambda p, x: ntk_core.empirical_ntk(MIXING["batch mean"], p, x))(w, x)


def test_a_users_grad_of_a_value_the_model_closes_over():
    """jax.grad of a kernel with respect to a value the model closes over (a scale) was
    refused: the probe's and the phases' jits took XLA options inside the user's trace
    (found by the reviewing helper). The gradient now equals a float64 reference's; the
    proof still covers the model, and an unproved one is warned about."""
    w = jax.random.normal(jax.random.PRNGKey(0), (5, 4))
    x = jax.random.normal(jax.random.PRNGKey(1), (6, 5))

    def kernel_sum(s, apply=_dense, **kw):
        return ntk_core.empirical_ntk(lambda p, x: apply(p, x) * s, w, x, **kw).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grad = jax.grad(kernel_sum)(1.5)
    k1 = reference.ntk(_dense, w, x, None)[0]  # float64; d/ds Σ K(s) = 2 s Σ K(1)
    np.testing.assert_allclose(float(grad), 2 * 1.5 * np.sum(k1), rtol=1e-5)
    with pytest.warns(UserWarning, match="inside jax.jit or grad the samples' independence"):
        jax.grad(lambda s: kernel_sum(s, MIXING["batch mean"]))(1.5)


def test_inputs_at_the_probes_fixed_point_are_still_changed():
    """Every entry 0.2 is the fixed point of the probe's affine change (-1.5 x + 0.5): a
    cumulative sum over the batch of such inputs was accepted (found by a new user)."""
    w = jax.random.normal(jax.random.PRNGKey(0), (5, 4))
    with pytest.raises(ValueError, match="depends on the other samples"):
        ntk_core.empirical_ntk(MIXING["cumsum over samples"], w, jnp.full((6, 5), 0.2))


@jax.custom_vjp
def _identity_unproved(h):  # samples apart, but a custom_vjp: no proof, the numeric probe
    return h


_identity_unproved.defvjp(lambda h: (h, None), lambda _, g: (g,))


def _python_branch(w, x):
    return _dense(w, x) * (2.0 if x.shape[0] > 1 else 1.0)


READS_N_OR_PLACE = {
    "divided by N": lambda w, x: _dense(w, x) / x.shape[0],
    "place added": lambda w, x: _dense(w, x + jnp.arange(x.shape[0])[:, None]),
    "Python branch on N": _python_branch,
    "ones(N) summed": lambda w, x: _dense(w, x) * jnp.ones(x.shape[0]).sum(),
    "cumsum(ones(N)) as places": lambda w, x: (
        _dense(w, x) * jnp.cumsum(jnp.ones(x.shape[0]))[:, None]
    ),
    "loop of N steps": lambda w, x: (
        _dense(w, x) * jax.lax.fori_loop(0, x.shape[0], lambda i, c: c + 1.0, 0.0)
    ),
    "features cut to N": lambda w, x: _dense(w, x + x[:, : x.shape[0]].sum(-1, keepdims=True)),
    "parameter rows cut to N": lambda w, x: _dense(w, x) + jnp.tile(w, (2, 1))[: x.shape[0]],
    "place added, custom_vjp": lambda w, x: _identity_unproved(
        _dense(w, x) * jnp.arange(1, x.shape[0] + 1)[:, None]
    ),
}


@pytest.mark.parametrize("name", list(READS_N_OR_PLACE))
def test_models_reading_n_or_their_place_are_refused(name):
    """A model whose sample sees N or its place in the batch (x / N, a positional code
    over the batch) got, silently, the kernel of a batch of one per sample (found in a
    review: 6 to 1e5 off). The jaxprs on 3 samples and 1 must differ in sizes only (else
    each row is run alone); vmap_axes=None is the float64 reference's. A random mask drawn
    with a fixed key (dropout with rngs=) stays accepted: every sample sees the mask of a
    batch of one, as documented."""
    f, w = READS_N_OR_PLACE[name], jax.random.normal(jax.random.PRNGKey(0), (5, 4))
    x = jax.random.normal(jax.random.PRNGKey(1), (6, 5))
    with pytest.raises(ValueError, match="depends on N or on its place in the batch"):
        ntk_core.empirical_ntk(f, w, x)
    with pytest.raises(ValueError, match="splits interacting samples"):
        ntk_core.empirical_ntk(f, w, x, vmap_axes=None, batch_size=2)
    expected = reference.ntk(f, w, x, None)[0]
    reference.assert_close(ntk_core.empirical_ntk(f, w, x, vmap_axes=None), expected)


def test_a_chaotic_recurrence_is_not_taken_for_reading_n():
    """Float32 tanh RNNs of gain 2.5 over 100 steps (a scan: the numeric probe) were refused
    as reading N (found by two helpers): a row's derivative on a batch of three and alone
    differ by up to 1.2e-2, rounding the recurrence amplifies (its outputs by 4e-5); rows
    alone are compared by their outputs. The kernel is the float64 reference's to the
    float32 accuracy such a recurrence allows (a float32 reference differs from it by up
    to 0.3 %, and from the kernel by 1.1 % where their programs' XLA options differ)."""

    def weights(seed, shape, scale):
        return (np.random.default_rng(seed).standard_normal(shape) * scale).astype("f4")

    for width, inputs, seeds in ((64, 4, (1, 2, 3, 4)), (16, 3, (0, 1, 2, 3))):
        p = {
            "wi": weights(seeds[0], (inputs, width), 1.0 if width == 64 else 0.5),
            "wh": weights(seeds[1], (width, width), 2.5 / np.sqrt(width)),
            "v": weights(
                seeds[2], (width, 2 if width == 64 else 3), 1 / 8 if width == 64 else 0.25
            ),
        }

        def rnn(p, x, width=width):
            def step(h, xt):
                return jnp.tanh(xt @ p["wi"] + h @ p["wh"]), None

            h0 = jnp.zeros((x.shape[0], width), x.dtype)
            h, _ = jax.lax.scan(step, h0, jnp.swapaxes(x, 0, 1))
            return h @ p["v"]

        x = weights(seeds[3], (4, 100, inputs), 1.0)
        k = np.asarray(ntk_core.empirical_ntk(rnn, p, x))
        with jax.enable_x64(True):  # float32's rounding, amplified, differs per program
            p64, x64 = jax.tree.map(lambda v: v.astype("f8"), (p, x))
            expected = reference.ntk(rnn, p64, x64, None)[0]
        assert np.abs(k - expected).max() <= 1e-2 * np.abs(expected).max()


def test_integers_equal_to_n_count_as_sizes_only_in_size_parameters():
    """An axis number or a precision's bits equal to N (found by a helper, 0.04-0.8 off)
    was taken for a size that scales with N: only shape-like parameters may."""
    w = jax.random.normal(jax.random.PRNGKey(0), (5, 8))
    bits = lambda w, x: jax.lax.reduce_precision(3 * _dense(w, x), 8, x.shape[0])  # noqa: E731
    with pytest.raises(ValueError, match="depends on N or on its place in the batch"):
        ntk_core.empirical_ntk(bits, w, jax.random.normal(jax.random.PRNGKey(1), (6, 5)))

    def cumsum_on_axis_n(w, x):
        return jnp.cumsum(_dense(w, x).reshape(-1, 2, 2, 2), axis=x.shape[0]).reshape(-1, 8)

    with pytest.raises(ValueError, match="depends on N or on its place in the batch"):
        ntk_core.empirical_ntk(
            cumsum_on_axis_n, w, jax.random.normal(jax.random.PRNGKey(1), (3, 5))
        )
