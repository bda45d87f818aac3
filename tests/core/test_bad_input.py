"""The bad-input table: every malformed call of the public API and its error (type and
one key fragment of the message).

``ROWS`` is the table; ``docs/errors.md`` shows it (generated from ``ROWS``, checked
by ``test_docs_table_is_current``). Adding a malformed call is one ``Row`` here, then
``python tests/core/test_bad_input.py`` to rewrite the docs table. Each call is a
source string evaluated after ``SETUP`` (and ``FLAX_SETUP`` / ``HAIKU_SETUP`` /
``EQUINOX_SETUP`` for rows
that need those libraries), so the documentation shows exactly what is tested.

Every error must be a ``TypeError`` or ``ValueError`` whose message starts with the
public function's name, says what was received and what was expected, and gives the
fix (``Fix:``); warnings are ``ntk_core.PrecisionWarning``. Never an AssertionError, a
JAX internal traceback, a hang or a silent wrong answer.
"""

from __future__ import annotations

import functools
import pathlib
import sys
from typing import NamedTuple

import pytest

if __name__ == "__main__":  # run as a script: the tests' helpers live in tests/
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import frameworks  # noqa: E402
from ntk_core import NonFiniteError  # noqa: E402

SETUP = """\
import functools
import jax, jax.numpy as jnp, numpy as np
import ntk_core, ntk_core.testing
from ntk_core import stax

W = jnp.ones((3, 2))                         # params of f
X = jnp.ones((4, 3))                         # 4 samples of 3 features
f = lambda w, x: jnp.tanh(x @ w)             # (N, 3) -> (N, 2)
mlp = lambda p, x: jnp.tanh(x @ p["w"]) @ p["v"]
P = {"w": jnp.ones((3, 5)), "v": jnp.ones((5, 2))}
embed = lambda p, tokens: p["e"][tokens].sum(1)   # integer tokens (N, T) -> (N, 2)
E = {"e": jnp.ones((10, 2))}
centred = lambda w, x: (x @ w) - (x @ w).mean(0)  # samples interact (batch mean)
fixed_batch = lambda w, x: x.reshape(4, -1) @ w    # works only on batches of 4
XS = X + jnp.arange(4.0)[:, None]            # distinct samples
def leak(s):                                 # closes over a traced value that escapes
    global leaky
    leaky = lambda w, x: jnp.tanh(x @ w) * s
    return s
jax.jit(leak)(2.0)                           # leaky now holds a leaked tracer
"""

FLAX_SETUP = """\
import flax.linen as nn
from flax import nnx
import ntk_flax

class Drop(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        return nn.Dropout(0.5, deterministic=not train)(nn.Dense(2)(x))

class BN(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        return nn.Dense(2)(nn.BatchNorm(use_running_average=not train)(x))

class Drop2(nn.Module):  # train has no default
    @nn.compact
    def __call__(self, x, train):
        return nn.Dropout(0.5, deterministic=not train)(nn.Dense(2)(x))

class Masked(nn.Module):  # two per-sample arrays: model(x, mask)
    @nn.compact
    def __call__(self, x, mask):
        return nn.Dense(2)(x * mask)

dense = nn.Dense(2)
V = dense.init(jax.random.PRNGKey(0), X)                     # {"params": ...}
V_DROP = Drop().init(jax.random.PRNGKey(0), X, train=False)
V_BN = BN().init(jax.random.PRNGKey(0), X)                   # params + batch_stats
V_MASK = Masked().init(jax.random.PRNGKey(0), X, X)
"""

HAIKU_SETUP = """\
import haiku as hk
import ntk_haiku

net = hk.transform(lambda x: hk.Linear(2)(x))
HP = net.init(jax.random.PRNGKey(0), X)
drop_net = hk.transform(lambda x: hk.dropout(hk.next_rng_key(), 0.5, hk.Linear(2)(x)))

def bn_forward(x, is_training):
    return hk.Linear(2)(hk.BatchNorm(True, True, 0.9)(x, is_training))

bn_net = hk.transform_with_state(bn_forward)
BP, BS = bn_net.init(jax.random.PRNGKey(0), X, is_training=True)

def scale_forward(x):
    return hk.Linear(2)(x) * hk.get_state("scale", (), init=jnp.ones)

scale_net = hk.without_apply_rng(hk.transform_with_state(scale_forward))
SP, SS = scale_net.init(jax.random.PRNGKey(0), X)
"""

EQUINOX_SETUP = """\
import equinox as eqx
import ntk_equinox

eqx_drop = eqx.nn.Sequential([eqx.nn.Linear(3, 2, key=jax.random.PRNGKey(0)), eqx.nn.Dropout(0.5)])
eqx_lin = eqx.nn.Linear(3, 2, key=jax.random.PRNGKey(0))
"""


class Row(NamedTuple):
    """One malformed call: ``call`` is evaluated; ``raises`` with a message matching
    ``match`` (``re.search``: one key fragment, the start of the message) and giving the
    fix (``Fix:``) is expected. ``needs``: extra setups ("flax", "haiku", "equinox")."""

    id: str
    mistake: str
    call: str
    raises: type
    match: str
    needs: tuple = ()


def _rows():
    import ntk_core

    PW = ntk_core.PrecisionWarning
    return [
        # -- shapes and sizes ---------------------------------------------------------
        Row("x2-shape", "x1 and x2 whose per-sample shapes differ",
            "ntk_core.empirical_ntk(f, W, X, jnp.ones((2, 5)))",
            ValueError, r"^empirical_ntk: x1 and x2 differ per sample: \(4, 3\) vs \(2, 5\)"),
        Row("empty-x1", "x1 with no samples (N=0)",
            "ntk_core.empirical_ntk(f, W, jnp.ones((0, 3)))",
            ValueError, r"^empirical_ntk: x1 is empty \(shapes \(0, 3\)\)"),
        Row("empty-x2", "x2 with no samples (N=0)",
            "ntk_core.empirical_ntk(f, W, X, jnp.ones((0, 3)))",
            ValueError, r"^empirical_ntk: x2 is empty"),
        Row("ragged-batch", "a pytree input whose leaves have different N",
            'ntk_core.empirical_ntk(lambda w, x: x["a"] @ w, W, {"a": X, "b": jnp.ones((3, 1))})',
            ValueError, r"^empirical_ntk: the arrays of x1 disagree on the batch size"),
        Row("x-structures", "x1 and x2 of different pytree structures",
            'ntk_core.empirical_ntk(lambda w, x: x["a"] @ w, W, {"a": X}, {"b": X})',
            ValueError, r"^empirical_ntk: x1 and x2 differ per sample: \{'a': \(4, 3\)\} vs \{'b': \(4, 3\)\}"),
        Row("batch-diagonal-N", "diagonal_axes=(0,) (per-sample diagonal) with x2 of another N",
            "ntk_core.empirical_ntk(f, W, X, jnp.ones((2, 3)), diagonal_axes=(0,))",
            ValueError, r"^empirical_ntk: diagonal_axes=\(0,\) needs N1 == N2, got N1=4 and N2=2"),
        Row("single-sample", "one sample without its batch axis",
            "ntk_core.empirical_ntk(f, W, jnp.ones(3))",
            ValueError, r"^empirical_ntk: the output has shape \(2,\) but x1 has 3 samples"),
        Row("python-list", "x as a nested Python list",
            "ntk_core.empirical_ntk(f, W, [[1.0, 2.0, 3.0]])",
            ValueError, r"^empirical_ntk: x1 holds a scalar.*Fix: pass jnp\.asarray\(x1\)"),
        Row("swapped-params-x", "params and x swapped (argument order)",
            'ntk_core.empirical_ntk(mlp, X, P)',
            ValueError, r"argument order is \(params, x1, x2\)"),
        Row("nt-kernel-order", "the built kernel called in neural-tangents' order (x1, x2, params)",
            "ntk_core.ntk_fn(mlp)(X, None, P)",
            ValueError, r"^ntk_fn: x1 has no arrays \(got None\)"),
        Row("nt-kernel-order-x2", "the built kernel called as kernel(x1, x2, params), x2 given",
            "ntk_core.ntk_fn(mlp)(X, 2 * X, P)",
            ValueError, r"^ntk_fn: the arguments look in neural-tangents' order \(x1, x2, params\)"),
        Row("nt-order-one-call", "empirical_ntk(f, x1, x2, params) with plain-array params",
            "ntk_core.empirical_ntk(f, X, 2 * X, W)",
            ValueError, r"^empirical_ntk: the arguments look in neural-tangents' order \(x1, x2, params\)"),
        Row("swapped-arrays", "params and x swapped, both plain arrays",
            "ntk_core.empirical_ntk(f, X, W)",
            ValueError, r"^empirical_ntk: calling the model on x1 \(shapes \(3, 2\)\) failed with TypeError"),
        Row("output-no-batch", "a model that sums over the batch",
            "ntk_core.empirical_ntk(lambda w, x: jnp.sum(x @ w), W, X)",
            ValueError, r"^empirical_ntk: the output has shape \(\) but x1 has 4 samples"),
        Row("no-output", "a model that returns None",
            "ntk_core.empirical_ntk(lambda w, x: None, W, X)",
            ValueError, r"^empirical_ntk: the model returned no arrays \(None\)"),
        # -- params -------------------------------------------------------------------
        Row("params-tree", "params whose tree does not match the model (missing leaf)",
            'ntk_core.empirical_ntk(mlp, {"w": P["w"]}, X)',
            ValueError, r"^empirical_ntk: calling the model on x1 \(shapes \(4, 3\)\) failed with KeyError: 'v'"),
        Row("params-shape", "params of the wrong shape",
            "ntk_core.empirical_ntk(f, jnp.ones((5, 2)), X)",
            ValueError, r"^empirical_ntk: calling the model on x1 .* failed with TypeError: dot_general"),
        Row("params-empty", "params with no arrays",
            "ntk_core.empirical_ntk(f, {}, X)",
            ValueError, r"^empirical_ntk: params has no arrays \(got dict\)"),
        Row("params-string", "a non-array leaf (a name) inside params",
            'ntk_core.empirical_ntk(lambda p, x: x @ p["w"], {"w": W, "name": "layer"}, X)',
            TypeError, r"^empirical_ntk: params\['name'\] has dtype <U5; expected real floating point"),
        Row("params-int", "integer params",
            "ntk_core.empirical_ntk(f, jnp.ones((3, 2), jnp.int32), X)",
            TypeError, r"^empirical_ntk: params has dtype int32"),
        Row("params-complex", "complex params",
            "ntk_core.empirical_ntk(f, W.astype(jnp.complex64), X)",
            TypeError, r"^empirical_ntk: params has dtype complex64; expected real"),
        # -- dtypes -------------------------------------------------------------------
        Row("float-tokens", "float inputs to a model that indexes with integer tokens",
            "ntk_core.empirical_ntk(embed, E, jnp.ones((4, 3)))",
            ValueError, r"^empirical_ntk: calling the model on x1 .* failed with TypeError: Indexer must have integer"),
        Row("x2-int", "integer x2 where x1 is floating point",
            "ntk_core.empirical_ntk(f, W, X, jnp.ones((2, 3), jnp.int32))",
            TypeError, r"^empirical_ntk: x1 has dtype float32 where x2 has int32"),
        Row("x-prng-keys", "typed PRNG keys as inputs",
            "ntk_core.empirical_ntk(f, W, jax.random.split(jax.random.key(0), 4))",
            TypeError, r"^empirical_ntk: x1 has dtype key<fry>; expected numbers"),
        Row("x-strings", "string inputs",
            'ntk_core.empirical_ntk(f, W, np.array([["a", "b", "c"]]))',
            TypeError, r"^empirical_ntk: x1 has dtype <U1; expected numbers"),
        Row("output-int", "a model returning integer labels",
            "ntk_core.empirical_ntk(lambda w, x: jnp.argmax(x @ w, -1), W, X)",
            TypeError, r"^empirical_ntk: the output has dtype int32; expected real floating point"),
        Row("output-complex", "a model returning complex outputs",
            "ntk_core.empirical_ntk(lambda w, x: (x @ w) * (1 + 1j), W, X)",
            TypeError, r"^empirical_ntk: the output has dtype complex64; expected real"),
        Row("precision-option", "precision below 'highest' (TF32/bf16 passes on GPUs/TPUs)",
            'ntk_core.ntk_fn(f, precision="high")(W, X)',
            PW, r"^ntk_fn: precision='high' lets GPUs and TPUs use TF32"),
        Row("precision-model", "a model whose own matmuls ask for precision below 'highest'",
            'ntk_core.empirical_ntk(lambda w, x: jnp.dot(x, w, precision="default"), W, X)',
            PW, r"^empirical_ntk: the model itself asks for matmul precision below 'highest' \(dot_general"),
        # -- options ------------------------------------------------------------------
        Row("implementation-int", "a non-string implementation (neural-tangents' ints)",
            "ntk_core.empirical_ntk(f, W, X, implementation=1)",
            ValueError, r"^empirical_ntk: implementation=1 is neural-tangents' NtkImplementation.JACOBIAN_CONTRACTION"),
        Row("implementation-unknown", "an unknown implementation",
            'ntk_core.empirical_ntk(f, W, X, implementation="Jacobian")',
            ValueError, r"^empirical_ntk: implementation must be one of .* got 'Jacobian'"),
        Row("trace-range", "trace_axes out of range",
            "ntk_core.empirical_ntk(f, W, X, trace_axes=(2,))",
            ValueError, r"^empirical_ntk: trace_axes contains 2, out of range for the output of shape \(4, 2\). Fix: pass output axes in \[1, 1\] or \[-1, -1\]"),
        Row("diagonal-range", "diagonal_axes out of range",
            "ntk_core.empirical_ntk(f, W, X, diagonal_axes=(-3,))",
            ValueError, r"^empirical_ntk: diagonal_axes contains -3, out of range"),
        Row("trace-duplicated", "trace_axes naming an axis twice",
            "ntk_core.empirical_ntk(f, W, X, trace_axes=(-1, -1))",
            ValueError, r"^empirical_ntk: trace_axes=\(-1, -1\) names the same axis twice"),
        Row("trace-duplicated-normalised", "trace_axes naming an axis twice (1 and -1)",
            "ntk_core.empirical_ntk(f, W, X, trace_axes=(1, -1))",
            ValueError, r"^empirical_ntk: trace_axes=\(1, -1\) names the same axis twice for the output of shape \(4, 2\)"),
        Row("diagonal-duplicated", "diagonal_axes naming an axis twice",
            "ntk_core.empirical_ntk(f, W, X, trace_axes=(), diagonal_axes=(1, 1))",
            ValueError, r"^empirical_ntk: diagonal_axes=\(1, 1\) names the same axis twice"),
        Row("axes-overlap", "an axis both traced and diagonal",
            "ntk_core.empirical_ntk(f, W, X, trace_axes=(1,), diagonal_axes=(-1,))",
            ValueError, r"^empirical_ntk: axis 1 of the output .* is in both trace_axes and diagonal_axes"),
        Row("trace-batch", "tracing the batch axis 0",
            "ntk_core.empirical_ntk(f, W, X, trace_axes=(0, 1))",
            ValueError, r"^empirical_ntk: trace_axes=\(0, 1\) traces the batch axis 0"),
        Row("trace-empty-axis", "tracing an output axis of size 0 (the mean of no values)",
            "ntk_core.empirical_ntk(lambda w, x: x @ w, jnp.ones((3, 0)), X)",
            ValueError, r"^empirical_ntk: trace_axes=\(-1,\) averages axis 1 of the output of shape \(4, 0\), which is empty. Fix: leave the empty axis out of trace_axes"),
        Row("trace-str", "trace_axes as a string",
            'ntk_core.empirical_ntk(f, W, X, trace_axes="-1")',
            TypeError, r"^empirical_ntk: trace_axes must be an int or a sequence of ints, got str '-1'"),
        Row("trace-none", "trace_axes=None (meaning 'no axes')",
            "ntk_core.empirical_ntk(f, W, X, trace_axes=None)",
            TypeError, r"^empirical_ntk: trace_axes must be an int or a sequence of ints, got NoneType None"),
        Row("vmap-axes", "vmap_axes other than 0 or None",
            "ntk_core.empirical_ntk(f, W, X, vmap_axes=1)",
            ValueError, r"^empirical_ntk: vmap_axes must be 0 or None, got 1\. Fix: move the batch axes first: f0 = lambda p, x: jnp\.moveaxis\(f\(p, jnp\.moveaxis\(x, 0, 1\)\), 1, 0\)"),
        Row("precision-unknown", "an unknown precision",
            'ntk_core.empirical_ntk(f, W, X, precision="tf32")',
            ValueError, r"^empirical_ntk: precision must be one of 'highest', 'high', 'default', got 'tf32'"),
        Row("per-leaf-ntvp", "the per-leaf NTK with NTK-vector products",
            'ntk_core.empirical_ntk_per_leaf(f, W, X, implementation="ntvp")',
            ValueError, r"^empirical_ntk_per_leaf: per-leaf kernels need implementation 'jacobian', 'structured' or 'auto', got 'ntvp'"),
        Row("unknown-option", "an unknown option name",
            "ntk_core.empirical_ntk(f, W, X, batchsize=2)",
            TypeError, r"^empirical_ntk: unknown keyword argument\(s\) 'batchsize'; valid options are trace_axes, diagonal_axes"),
        Row("option-typo", "a misspelt option name",
            "ntk_core.empirical_ntk(f, W, X, diag_axes=(0,))",
            TypeError, r"^empirical_ntk: unknown keyword argument\(s\) 'diag_axes'.* Fix: write diagonal_axes= \(not diag_axes=\)"),
        Row("model-kwarg-to-ntk-fn", "a model keyword argument given to ntk_fn",
            "ntk_core.ntk_fn(f, train=False)",
            TypeError, r"^ntk_fn: unknown keyword argument\(s\) 'train'"),
        Row("positional-options", "options passed positionally (neural-tangents' order)",
            "ntk_core.empirical_ntk(f, W, X, None, (-1,))",
            TypeError, r"^empirical_ntk: too many positional arguments \(expected positional arguments apply_fn, params, x1, x2\)"),
        Row("missing-x1", "no inputs",
            "ntk_core.empirical_ntk(f, W)",
            TypeError, r"^empirical_ntk: missing a required argument: 'x1'"),
        Row("nngp-implementation", "implementation= given to the NNGP",
            'ntk_core.empirical_nngp(f, W, X, implementation="jacobian")',
            TypeError, r"^empirical_nngp: unknown keyword argument\(s\) 'implementation'; valid options are trace_axes, diagonal_axes, vmap_axes, precision"),
        Row("kernel-fn-options", "options or model arguments given to the built kernel function",
            "ntk_core.ntk_fn(f)(W, X, trace_axes=())",
            TypeError, r"^ntk_fn\(...\)\(params, x1, x2\): got the keyword argument\(s\) 'trace_axes'"),
        # -- apply_fn -----------------------------------------------------------------
        Row("apply-fn-str", "apply_fn that is not callable",
            'ntk_core.ntk_fn("f")',
            TypeError, r"^ntk_fn: apply_fn must be a callable apply_fn\(params, x\), got str"),
        Row("apply-fn-swapped", "params passed where apply_fn goes",
            "ntk_core.empirical_ntk(W, f, X)",
            TypeError, r"^empirical_ntk: apply_fn must be a callable apply_fn\(params, x\), got ArrayImpl"),
        Row("samples-interact", "a model whose samples interact (batch mean) with vmap_axes=0",
            "ntk_core.empirical_ntk(centred, W, XS)",
            ValueError, r"^empirical_ntk: the model's output for one sample depends on the other samples of its batch"),
        Row("samples-place", "a model reading N or its place in the batch (x / N) with vmap_axes=0",
            "ntk_core.empirical_ntk(lambda w, x: (x @ w) / x.shape[0], W, XS)",
            ValueError, r"^empirical_ntk: the model's output for one sample depends on N or on its place in the batch\. Fix: pass vmap_axes=None"),
        Row("fixed-batch", "a model that works only at one batch size, with vmap_axes=0",
            "ntk_core.empirical_ntk(fixed_batch, W, XS)",
            ValueError, r"^empirical_ntk: the model runs on x1's batch of 4 samples but not on one \(vmap_axes=0\)"),
        Row("leaked-tracer", "a model closing over a tracer that escaped an earlier jax.jit",
            "ntk_core.empirical_ntk(leaky, W, X)",
            ValueError, r"^empirical_ntk: the model uses a leaked tracer"),
        Row("leaked-tracer-whole-batch", "the same, differentiating the whole batch (vmap_axes=None)",
            "ntk_core.empirical_ntk(leaky, W, X, vmap_axes=None)",
            ValueError, r"^empirical_ntk: the model uses a leaked tracer"),
        Row("whole-batch-over-budget", "vmap_axes=None on a batch whose forward and one reverse pass exceed memory_budget",
            "ntk_core.empirical_ntk(f, W, X, vmap_axes=None, memory_budget=64)",
            ValueError, r"^empirical_ntk: vmap_axes=None differentiates 4 samples at once"),
        Row("auto-one-call-slower-than-tiles", "implementation='auto' inside a JAX transformation (no tiles there) where only NTK-vector products fit in one call and tiles are estimated >= 2x faster (a warning; outside, auto takes the tiles)",
            "jax.eval_shape(lambda x: ntk_core.ntk_fn(mlp)(P, x), jnp.ones((24000, 3)))",
            UserWarning, r"^ntk_fn: implementation='auto' with batch_size=None inside a JAX transformation took 'ntvp': the features of faster ones do not fit in one call, and tiles run outside transformations; in tiles \(batch_size='auto'\), 'jacobian' is estimated at ~.* s \(.*x faster than 'ntvp' in one call.*Fix: call the kernel function outside jax.jit"),
        Row("core-linen-module", "a flax.linen module passed to the core",
            "ntk_core.empirical_ntk(dense, V, X)",
            TypeError, r"^empirical_ntk: apply_fn is the model Dense, not apply_fn\(params, x\)", ("flax",)),
        Row("core-nnx-module", "a flax.nnx module passed to the core",
            "ntk_core.empirical_ntk(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), W, X)",
            TypeError, r"^empirical_ntk: apply_fn is the model Linear", ("flax",)),
        Row("core-variables-params", "model.apply with variables['params'] instead of variables",
            'ntk_core.empirical_ntk(dense.apply, V["params"], X)',
            ValueError, r"^empirical_ntk: model.apply needs the variables \{'params': ...\} alone, got \['bias', 'kernel'\]", ("flax",)),
        Row("core-variables-batch-stats", "model.apply with variables holding batch_stats (would be differentiated)",
            "ntk_core.empirical_ntk(functools.partial(BN().apply, train=False), V_BN, X)",
            ValueError, r"^empirical_ntk: model.apply needs the variables .* got \['batch_stats', 'params'\]", ("flax",)),
        Row("core-variables-custom-apply", "variables instead of variables['params'] to an apply_fn that wraps them",
            'ntk_core.empirical_ntk(lambda p, x: dense.apply({"params": p}, x), V, X)',
            ValueError, r"^empirical_ntk: calling the model on x1 .* failed with .*Fix: .*for Flax variables use ntk_flax.kernel", ("flax",)),
        Row("core-haiku-transformed", "an hk.Transformed passed to the core",
            "ntk_core.empirical_ntk(net, HP, X)",
            TypeError, r"^empirical_ntk: apply_fn is the model Transformed", ("haiku",)),
        Row("core-haiku-apply-with-rng", "a Haiku apply that expects an rng, passed to the core",
            "ntk_core.empirical_ntk(net.apply, HP, X)",
            ValueError, r"^empirical_ntk: calling the model on x1 .* failed with ValueError: Apply must be called with an RNG", ("haiku",)),
        Row("core-mc-nt-style", "neural-tangents' monte_carlo_kernel_fn(init_fn, apply_fn, key, n_samples) call",
            "ntk_core.monte_carlo_kernels(lambda k, s: (s, {}), f, jax.random.PRNGKey(0), 8)",
            TypeError, r"^monte_carlo_kernels: the arguments look like neural-tangents' \(init_fn, apply_fn, key, n_samples\)"),
        Row("core-mc-nt-style-key-init", "the same call with a key-only init_fn",
            "ntk_core.monte_carlo_kernels(lambda k: {}, f, jax.random.PRNGKey(0), 8)",
            TypeError, r"^monte_carlo_kernels: the arguments look like neural-tangents'"),
        Row("core-mc-stax-init", "a stax-style init_fn(key, shape) with otherwise correct arguments",
            "ntk_core.monte_carlo_kernels(lambda k, s: (s, {}), f, X, key=jax.random.PRNGKey(0), n_samples=2)",
            TypeError, r"^monte_carlo_kernels: init_fn takes \(key, shape\)"),
        Row("core-mc-params-as-x1", "parameters passed to the Monte Carlo function as x1, as in empirical_ntk",
            "ntk_core.monte_carlo_kernels(lambda k: P, mlp, P, X, key=jax.random.PRNGKey(0), n_samples=2)",
            TypeError, r"^monte_carlo_kernels: x1 is a dict of \['v', 'w'\], which looks like a model's parameters"),
        Row("core-mc-layer-list-as-x1", "a list of layer parameters (stax style) passed as x1, x2 one array",
            "ntk_core.monte_carlo_kernels(lambda k: [W], lambda p, x: f(p[0], x), [W], X, key=jax.random.PRNGKey(0), n_samples=2)",
            TypeError, r"^monte_carlo_kernels: x1 is a list of length 1 where x2 is one array, which looks like a model's parameters"),
        Row("core-mc-invalid-batch-size-vmapped", "an invalid batch_size with samples vmapped together (the value is named first)",
            "ntk_core.monte_carlo_kernels(lambda k: W, f, X, key=jax.random.PRNGKey(0), n_samples=4, batch_size_samples=2, batch_size='x')",
            ValueError, r"^monte_carlo_kernels: batch_size must be None, a positive int or 'auto', got the string 'x'"),
        Row("core-mc-batch-size-in-vmapped-samples", "the blocked engine's batch_size with samples vmapped together",
            "ntk_core.monte_carlo_kernels(lambda k: W, f, X, key=jax.random.PRNGKey(0), n_samples=4, batch_size_samples=2, batch_size=2)",
            ValueError, r"^monte_carlo_kernels: batch_size cannot run inside batch_size_samples=2"),
        Row("core-out-under-a-file", "out= whose parent is a file (here the device /dev/null), not a folder",
            'ntk_core.ntk_fn(f, batch_size=2, out="/dev/null/k.npy")(W, X)',
            ValueError, r"^ntk_fn: out='/dev/null/k.npy': '/dev/null' is a file, where a folder is expected"),
        Row("core-out-no-writable-file-system", "out= on a file system that takes no files (/proc on Linux, even for root)",
            'ntk_core.ntk_fn(f, batch_size=2, out="/proc/k.npy")(W, X)',
            ValueError, r"^ntk_fn: out='/proc/k.npy': the (file cannot be created, '/proc' is not writable|folder '/proc' does not exist or cannot be written)"),
        # -- weight transplants (ntk_core.testing) -------------------------------------
        Row("transplant-swapped", "params_from_haiku given Flax params first",
            'ntk_core.testing.params_from_haiku({"Dense_0": {"kernel": W}}, {"linear": {"w": W}})',
            ValueError, r"^params_from_haiku: Haiku module 'Dense_0' holds \['kernel'\].*swap the two arguments"),
        Row("transplant-count", "a Haiku stack with another number of layers than the Flax one",
            'ntk_core.testing.params_from_haiku({"linear": {"w": W}}, {"Dense_0": {"kernel": W}, "Dense_1": {"kernel": W}})',
            ValueError, r"^params_from_haiku: got 2 Flax layers .* but 1 Haiku modules"),
        # -- ntk_flax -----------------------------------------------------------------
        Row("flax-rng-spelling", "Haiku's rng= given to the Flax adapter",
            "ntk_flax.kernel(Drop(), V_DROP, X, rng=jax.random.PRNGKey(0))",
            TypeError, r"^ntk_flax.kernel: unknown option\(s\) 'rng'", ("flax",)),
        Row("flax-dropout-rng", "a Flax model needing a dropout rng, without one",
            "ntk_flax.kernel(Drop(), V_DROP, X)",
            ValueError, r"^ntk_flax.kernel: the model needs a random key", ("flax",)),
        Row("flax-batchnorm-train", "BatchNorm in training mode with vmap_axes=0",
            "ntk_flax.kernel(BN(), V_BN, X)",
            ValueError, r"^ntk_flax.kernel: the model updates its variables .* as BatchNorm in training mode does", ("flax",)),
        Row("flax-no-params", "a dict without a 'params' collection that is not the model's params either (another model's)",
            'ntk_flax.kernel(dense, {"w": W}, X)',
            ValueError, r"^ntk_flax.kernel: variables looks like the parameters of another model: top-level names \[\x27w\x27\], where model.init makes \[\x27bias\x27, \x27kernel\x27\] for this one\. Fix: pass the model they belong to", ("flax",)),
        Row("flax-params-lacking", "a bare params dict with this model's layer names, lacking a parameter",
            'ntk_flax.kernel(Drop(), {"Dense_0": {"kernel": W}}, X)',
            ValueError, r"^ntk_flax.kernel: variables has no \x27params\x27 collection \(keys \[\x27Dense_0\x27\]\) and lacks 1 of the 2 parameters model.init makes \(\[\x27Dense_0\x27\]\[\x27bias\x27\]\)", ("flax",)),
        Row("flax-other-model-variables", "a variables dict of another model (its layers named otherwise)",
            'ntk_flax.kernel(dense, {"params": {"Dense_0": V["params"]}}, X)',
            ValueError, r"^ntk_flax.kernel: variables\[\x27params\x27\] looks like the parameters of another model: top-level names \[\x27Dense_0\x27\], where model.init makes \[\x27bias\x27, \x27kernel\x27\] for this one \(the model failed with", ("flax",)),
        Row("flax-nnx-other-model-state", "an nnx module given another module's nnx.Param state",
            "ntk_flax.kernel(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), nnx.state(nnx.Sequential(nnx.Linear(3, 2, rngs=nnx.Rngs(0))), nnx.Param), X)",
            ValueError, r"^ntk_flax.kernel: variables do not have the structure .*: they look like another model\x27s, with top-level names \[\x27layers\x27\] where the module has \[\x27bias\x27, \x27kernel\x27\]\. Fix: pass the module they belong to", ("flax",)),
        Row("flax-model-without-params", "a Flax model that makes no parameters",
            "ntk_flax.kernel(nn.Dropout(0.5, deterministic=True), {}, X)",
            ValueError, r"^ntk_flax.kernel: the model has no parameters", ("flax",)),
        Row("flax-variables-type", "variables that are not a dict (x passed instead)",
            "ntk_flax.kernel(dense, X, V)",
            TypeError, r"^ntk_flax.kernel: variables must be the dict returned by model.init\(...\), its \[\x27params\x27\] or a train state, got ArrayImpl", ("flax",)),
        Row("flax-nnx-linen-variables", "an nnx module given a linen variables dict",
            "ntk_flax.kernel(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), V, X)",
            ValueError, r"^ntk_flax.kernel: variables do not have the structure of the module\x27s nnx.Param state", ("flax",)),
        Row("flax-nnx-monte-carlo-module", "an nnx module (already initialised) given to the Monte Carlo kernels",
            "ntk_flax.monte_carlo_kernels(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), X, key=jax.random.PRNGKey(0), n_samples=2)",
            TypeError, r"^ntk_flax.monte_carlo_kernels: model must be a linen module or a function building an nnx module, got the nnx module Linear", ("flax",)),
        Row("flax-nnx-train-dropout", "an nnx module with Dropout in training mode",
            "ntk_flax.nngp(nnx.Sequential(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), nnx.Dropout(0.5, rngs=nnx.Rngs(1))), None, X)",
            ValueError, r"^ntk_flax.nngp: the nnx module changes its own state when called \(RngCount at layers/1/\S*count\)", ("flax",)),
        Row("flax-mc-batch-size-in-vmapped-samples", "the blocked engine's batch_size with samples vmapped together",
            "ntk_flax.monte_carlo_kernels(dense, X, key=jax.random.PRNGKey(0), n_samples=4, batch_size_samples=2, batch_size=2)",
            ValueError, r"^ntk_flax.monte_carlo_kernels: batch_size cannot run inside batch_size_samples=2", ("flax",)),
        Row("flax-mc-nan-vmapped", "NaN inputs with samples vmapped together",
            "ntk_flax.monte_carlo_kernels(dense, X.at[1, 0].set(jnp.nan), key=jax.random.PRNGKey(0), n_samples=2, batch_size_samples=2)",
            NonFiniteError, r"^ntk_flax.monte_carlo_kernels: x1 contains NaN values, first in sample 1", ("flax",)),
        Row("flax-nnx-mc-no-params", "an nnx builder whose module has no nnx.Param",
            "ntk_flax.monte_carlo_kernels(lambda rngs: nnx.Sequential(nnx.relu), X, key=jax.random.PRNGKey(0), n_samples=2)",
            ValueError, r"^ntk_flax.monte_carlo_kernels: the module model\(nnx.Rngs\(key\)\) builds, Sequential, has no nnx.Param variables", ("flax",)),
        Row("flax-nnx-variables-shapes", "nnx variables of another width (same structure)",
            "ntk_flax.kernel(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), nnx.state(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.Param), X)",
            ValueError, r"^ntk_flax.kernel: variables do not have the shapes of the module\x27s nnx.Param state: .*\(4,\) \(expected \(2,\)\)", ("flax",)),
        Row("flax-mc-linen-class", "the linen class instead of an instance, for the Monte Carlo kernels",
            "ntk_flax.monte_carlo_kernels(nn.Dense, X, key=jax.random.PRNGKey(0), n_samples=2)",
            TypeError, r"^ntk_flax.monte_carlo_kernels: model is the linen class Dense, not an instance", ("flax",)),
        Row("flax-mc-params-as-x1", "variables passed to the Monte Carlo function as in ntk_flax.kernel",
            "ntk_flax.monte_carlo_kernels(dense, V, X, key=jax.random.PRNGKey(0), n_samples=2)",
            TypeError, r"^ntk_flax.monte_carlo_kernels: x1 is a dict of \['params'\], which looks like a model's parameters", ("flax",)),
        Row("flax-mc-list-input", "a Python list as x1 of the Monte Carlo function",
            "ntk_flax.monte_carlo_kernels(dense, X.tolist(), key=jax.random.PRNGKey(0), n_samples=2)",
            TypeError, r"^ntk_flax.monte_carlo_kernels: x1 must be arrays with a batch axis 0, got list", ("flax",)),
        Row("flax-mc-misspelt-option", "a misspelt Monte Carlo option (batch_size_sample)",
            "ntk_flax.monte_carlo_kernels(dense, X, key=jax.random.PRNGKey(0), n_samples=2, batch_size_sample=2)",
            TypeError, r"^ntk_flax.monte_carlo_kernels: unknown option\(s\) 'batch_size_sample' \(did you mean 'batch_size_samples'", ("flax",)),
        Row("flax-kernel-missing-x", "the variables forgotten: ntk_flax.kernel(model, x)",
            "ntk_flax.kernel(dense, X)",
            TypeError, r"^ntk_flax.kernel: missing a required argument: 'x1' \(expected positional arguments model, variables, x1, x2\)", ("flax",)),
        Row("flax-nnx-mutating-call", "an nnx module whose call writes its own state (vmap_axes=None)",
            "ntk_flax.kernel(nnx.Sequential(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), nnx.BatchNorm(2, rngs=nnx.Rngs(0))), None, X, vmap_axes=None)",
            ValueError, r"^ntk_flax.kernel: the nnx module changes its own state when called \(BatchStat at layers/1/mean, BatchStat at layers/1/var\)", ("flax",)),
        Row("flax-nnx-rngs", "rngs= given for an nnx module (which carries its own)",
            "ntk_flax.kernel(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), None, X, rngs={'dropout': jax.random.PRNGKey(0)})",
            TypeError, r"^ntk_flax.kernel: rngs was given, but an nnx module carries its own nnx.Rngs", ("flax",)),
        Row("flax-apply-fn", "model.apply passed instead of the module",
            "ntk_flax.kernel(dense.apply, V, X)",
            TypeError, r"^ntk_flax.kernel: model must be a flax.linen.Module or a flax.nnx.Module, got method", ("flax",)),
        Row("flax-argument-order", "neural-tangents' argument order (variables first)",
            "ntk_flax.kernel(V, dense, X)",
            TypeError, r"^ntk_flax.kernel: model must be a flax.linen.Module or a flax.nnx.Module, got dict", ("flax",)),
        Row("flax-model-kwarg-as-option", "a model keyword argument passed as an option",
            "ntk_flax.kernel(Drop(), V_DROP, X, train=False)",
            TypeError, r"^ntk_flax.kernel: unknown option\(s\) 'train'", ("flax",)),
        Row("flax-apply-kwargs-type", "apply_kwargs that is not a dict",
            'ntk_flax.kernel(Drop(), V_DROP, X, apply_kwargs=["train", False])',
            TypeError, r"^ntk_flax.kernel: apply_kwargs must be a dict of the model's keyword arguments, got list", ("flax",)),
        Row("flax-input-shape", "inputs of the wrong per-sample shape (5 features for a Dense layer initialised with 3)",
            "ntk_flax.kernel(dense, V, jnp.ones((4, 5)))",
            ValueError, r"^ntk_flax.kernel: applying the model to x1 failed: x1 has per-sample shape \(5,\), but variables were made by model.init for inputs of per-sample shape \(3,\)", ("flax",)),
        Row("flax-apply-kwargs-mutable", "apply_kwargs={'mutable': [...]} (the kernel needs a pure function of params)",
            'ntk_flax.kernel(BN(), V_BN, X, apply_kwargs={"mutable": ["batch_stats"]})',
            TypeError, r"^ntk_flax.kernel: apply_kwargs holds \x27mutable\x27", ("flax",)),
        Row("flax-missing-batch-stats", "a BatchNorm model given only {'params': ...}, without its batch_stats",
            'ntk_flax.kernel(BN(), {"params": V_BN["params"]}, X, apply_kwargs={"train": False})',
            ValueError, r"^ntk_flax.kernel: variables \(holding \[\x27params\x27\]\) lacks the collection\(s\) \[\x27batch_stats\x27\], which the model reads", ("flax",)),
        Row("flax-bare-params-batch-stats", "a BatchNorm model given its bare params dict (variables['params'], state.params), without its batch_stats",
            'ntk_flax.kernel(BN(), V_BN["params"], X, apply_kwargs={"train": False})',
            ValueError, r"^ntk_flax.kernel: variables is a bare params dict without the collection\(s\) \[\x27batch_stats\x27\], which the model reads", ("flax",)),
        Row("flax-single-sample", "one sample without its batch axis (Flax)",
            "ntk_flax.kernel(dense, V, X[0])",
            ValueError, r"^ntk_flax.kernel: the output has shape \(2,\) but x1 has 3 samples", ("flax",)),
        Row("flax-missing-model-argument", "a model argument (train) neither defaulted nor given",
            "ntk_flax.kernel(Drop2(), V_DROP, X)",
            ValueError, r"^ntk_flax.kernel: applying the model to x1 failed: TypeError: .*missing 1 required positional argument: 'train'.* flags in apply_kwargs", ("flax",)),
        Row("flax-method-unknown", "method= naming no method of the linen module",
            "ntk_flax.kernel(dense, V, X, method='encode')",
            TypeError, r"^ntk_flax.kernel: method='encode' names no method of Dense", ("flax",)),
        Row("flax-per-sample-apply-kwargs", "a per-sample mask passed in apply_kwargs (held fixed)",
            "ntk_flax.kernel(Masked(), V_MASK, X, apply_kwargs={'mask': X})",
            ValueError, r"^ntk_flax.kernel: the model runs on x1's batch of 4 samples but not on one .* Fix: pass per-sample arrays in x1 \(adapters: inputs='kwargs'\)", ("flax",)),
        Row("flax-missing-per-sample-array", "a model of two per-sample arrays (x, mask) given x alone",
            "ntk_flax.kernel(Masked(), V_MASK, X)",
            ValueError, r"^ntk_flax.kernel: applying the model to x1 failed: TypeError: .*missing 1 required positional argument: 'mask'. Fix: pass per-sample arrays in x1 with inputs='args' or 'kwargs'", ("flax",)),
        Row("flax-inputs-value", "inputs= none of 'x', 'args', 'kwargs'",
            'ntk_flax.kernel(Masked(), V_MASK, (X, X), inputs="tuple")',
            ValueError, r"^ntk_flax.kernel: inputs must be 'x', 'args' or 'kwargs', got 'tuple'", ("flax",)),
        Row("flax-inputs-args-dict", "inputs='args' with x1 a dict",
            'ntk_flax.kernel(Masked(), V_MASK, {"x": X, "mask": X}, inputs="args")',
            TypeError, r"^ntk_flax.kernel: inputs='args' needs x1 as a tuple of per-sample arrays, got dict. Fix: pass a tuple, inputs='kwargs' for a dict", ("flax",)),
        Row("nnx-inputs-kwargs-array", "inputs='kwargs' with x1 one array (nnx)",
            'ntk_flax.kernel(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), None, X, inputs="kwargs")',
            TypeError, r"^ntk_flax.kernel: inputs='kwargs' needs x1 as a dict of per-sample arrays, got ArrayImpl", ("flax",)),
        Row("flax-inputs-ragged", "inputs='args' whose arrays have different N",
            'ntk_flax.kernel(Masked(), V_MASK, (X, X[:2]), inputs="args")',
            ValueError, r"^ntk_flax.kernel: the arrays of x1 disagree on the batch size \(axis 0\): \(\(4, 3\), \(2, 3\)\)", ("flax",)),
        Row("flax-nngp-implementation", "implementation= given to the Flax NNGP",
            'ntk_flax.nngp(dense, V, X, implementation="ntvp")',
            TypeError, r"^ntk_flax.nngp: unknown option\(s\) 'implementation'", ("flax",)),
        Row("flax-per-leaf-ntvp", "NTK-vector products asked for Flax per-leaf kernels",
            'ntk_flax.kernel_per_leaf(dense, V, X, implementation="ntvp")',
            ValueError, r"^ntk_flax.kernel_per_leaf: per-leaf kernels need implementation 'jacobian', 'structured' or 'auto', got 'ntvp'", ("flax",)),
        Row("flax-per-leaf-fn-ntvp", "the same when building the per-leaf kernel function (refused at once)",
            'ntk_flax.kernel_per_leaf_fn(dense, implementation="ntvp")',
            ValueError, r"^ntk_flax.kernel_per_leaf_fn: per-leaf kernels need implementation 'jacobian', 'structured' or 'auto', got 'ntvp'", ("flax",)),
        Row("flax-misspelt-option", "a misspelt option (trace_axis)",
            "ntk_flax.kernel(dense, V, X, trace_axis=())",
            TypeError, r"^ntk_flax.kernel: unknown option\(s\) 'trace_axis'", ("flax",)),
        Row("flax-unexpected-model-argument", "a misspelt key of apply_kwargs",
            'ntk_flax.kernel(Drop(), V_DROP, X, apply_kwargs={"training": False})',
            ValueError, r"^ntk_flax.kernel: applying the model to x1 failed: TypeError: .*unexpected keyword argument 'training'", ("flax",)),
        Row("flax-kernel-fn-order", "the built Flax kernel called in neural-tangents' order (x1, x2, variables)",
            "ntk_flax.kernel_fn(dense)(X, X, V)",
            TypeError, r"^ntk_flax.kernel_fn: variables must be the dict returned by model.init\(...\), .*got ArrayImpl", ("flax",)),
        Row("flax-kernel-fn-keyword", "a misspelt keyword of the built Flax kernel function",
            "ntk_flax.kernel_fn(dense)(V, X, rngz=1)",
            TypeError, r"^ntk_flax.kernel_fn\(...\)\(...\): unknown keyword argument\(s\) 'rngz'", ("flax",)),
        Row("flax-ragged-x", "a pytree input whose leaves have different N (Flax)",
            'ntk_flax.kernel(dense, V, {"a": X, "b": X[:2]})',
            ValueError, r"^ntk_flax.kernel: the arrays of x1 disagree on the batch size", ("flax",)),
        Row("flax-nngp-plan", "plan asked of an NNGP kernel function",
            "ntk_flax.nngp_fn(dense).plan(V, X)",
            ValueError, r"^ntk_flax.nngp_fn: plan\(\) describes NTK computations", ("flax",)),
        # -- ntk_haiku ----------------------------------------------------------------
        Row("haiku-no-state", "an hk.transform_with_state model without its state",
            'ntk_haiku.kernel(bn_net, BP, X, apply_kwargs={"is_training": False})',
            ValueError, r"^ntk_haiku.kernel: this hk.TransformedWithState needs its state", ("haiku",)),
        Row("haiku-plan-no-state", "ntk_haiku.plan of a stateful model without its state",
            'ntk_haiku.plan(bn_net, BP, X, apply_kwargs={"is_training": False})',
            ValueError, r"^ntk_haiku.plan: this hk.TransformedWithState needs its state", ("haiku",)),
        Row("haiku-batchnorm-train", "Haiku BatchNorm in training mode with vmap_axes=0",
            'ntk_haiku.kernel(bn_net, BP, XS, state=BS, apply_kwargs={"is_training": True})',
            ValueError, r"^ntk_haiku.kernel: the model's output for one sample depends on the other samples", ("haiku",)),
        Row("haiku-state-type", "a state that is not the mapping from transformed.init",
            'ntk_haiku.kernel(bn_net, BP, X, state=[BS], apply_kwargs={"is_training": False})',
            TypeError, r"^ntk_haiku.kernel: state must be the mapping returned by transformed.init\(key, x\) \(its second value\), got list", ("haiku",)),
        Row("haiku-state-plain", "state given to a plain hk.transform model",
            "ntk_haiku.kernel(net, HP, X, state={})",
            ValueError, r"^ntk_haiku.kernel: state was given but the model is a plain hk.Transformed", ("haiku",)),
        Row("haiku-rngs-spelling", "Flax's rngs= given to the Haiku adapter",
            "ntk_haiku.kernel(drop_net, HP, X, rngs=jax.random.PRNGKey(0))",
            TypeError, r"^ntk_haiku.kernel: unknown option\(s\) 'rngs'", ("haiku",)),
        Row("haiku-dropout-rng", "a Haiku model needing an rng, without one",
            "ntk_haiku.kernel(drop_net, HP, X)",
            ValueError, r"^ntk_haiku.kernel: the model needs a random key .* but rng=None", ("haiku",)),
        Row("haiku-params-state-tuple", "transform_with_state's (params, state) passed as params",
            "ntk_haiku.kernel(bn_net, (BP, BS), X, apply_kwargs={'is_training': False})",
            ValueError, r"^ntk_haiku.kernel: params is a tuple of two, as transformed.init returns \(params, state\)\. Fix: pass params, state=state", ("haiku",)),
        Row("haiku-rng-int", "rng=0 (an int) where a PRNG key is expected",
            "ntk_haiku.kernel(drop_net, HP, X, rng=0)",
            TypeError, r"^ntk_haiku.kernel: rng must be a PRNG key, got int 0\. Fix: pass rng=jax.random.PRNGKey\(0\)", ("haiku",)),
        Row("equinox-dropout-training", "an equinox model with eqx.nn.Dropout in training mode",
            "ntk_equinox.kernel(eqx_drop, X)",
            ValueError, r"^ntk_equinox.kernel: calling the model on x1 .* Dropout requires a key.*or the mode: eqx.nn.inference_mode\(model\)", ("equinox",)),
        Row("haiku-rng-unused", "rng given to an hk.without_apply_rng model",
            "ntk_haiku.kernel(hk.without_apply_rng(net), HP, X, rng=jax.random.PRNGKey(0))",
            ValueError, r"^ntk_haiku.kernel: rng was given but the model was built with hk.without_apply_rng", ("haiku",)),
        Row("haiku-not-transformed", "the forward function itself instead of hk.transform(f)",
            "ntk_haiku.kernel(lambda x: x, HP, X)",
            TypeError, r"^ntk_haiku.kernel: expected an hk.Transformed or hk.TransformedWithState, got function", ("haiku",)),
        Row("haiku-params-type", "params that are not a dict (x passed instead)",
            "ntk_haiku.kernel(net, X, X)",
            TypeError, r"^ntk_haiku.kernel: params must be the dict returned by transformed.init, got ArrayImpl", ("haiku",)),
        Row("haiku-model-kwarg-as-option", "a model keyword argument passed as an option",
            "ntk_haiku.kernel(bn_net, BP, X, state=BS, is_training=False)",
            TypeError, r"^ntk_haiku.kernel: unknown option\(s\) 'is_training'", ("haiku",)),
        Row("haiku-apply-kwargs-type", "apply_kwargs that is not a dict",
            'ntk_haiku.kernel(bn_net, BP, X, state=BS, apply_kwargs=[("is_training", False)])',
            TypeError, r"^ntk_haiku.kernel: apply_kwargs must be a dict of the model's keyword arguments, got list", ("haiku",)),
        Row("haiku-flax-variables", "Flax variables given to a Haiku model",
            "ntk_haiku.kernel(net, V, X)",
            ValueError, r"^ntk_haiku.kernel: params \(modules \[\x27params\x27\]\) lack \[\x27linear\x27\]\[\x27b\x27\], \[\x27linear\x27\]\[\x27w\x27\], which transformed.init makes", ("flax", "haiku")),
        Row("haiku-flat-params", "a flat dict of arrays (one Flax layer's params) given to a Haiku model",
            'ntk_haiku.kernel(net, V["params"], X)',
            ValueError, r"^ntk_haiku.kernel: params \(modules \[\x27bias\x27, \x27kernel\x27\]\) lack \[\x27linear\x27\]", ("flax", "haiku")),
        Row("haiku-params-missing-leaf", "params with one parameter of a module removed",
            'ntk_haiku.kernel(net, {"linear": {"w": HP["linear"]["w"]}}, X)',
            ValueError, r"^ntk_haiku.kernel: params \(modules \[\x27linear\x27\]\) lack \[\x27linear\x27\]\[\x27b\x27\], which transformed.init makes", ("haiku",)),
        Row("haiku-flax-params-nested", "a Flax model's params collection (modules of kernel/bias) given to a Haiku model",
            'ntk_haiku.kernel(net, {"Dense_0": V["params"]}, X)',
            ValueError, r"^ntk_haiku.kernel: params \(modules \[\x27Dense_0\x27\]\) lack \[\x27linear\x27\]", ("flax", "haiku")),
        Row("haiku-state-as-params", "Haiku state passed as params (integer counters)",
            'ntk_haiku.kernel(bn_net, BS, X, state=BS, apply_kwargs={"is_training": False})',
            TypeError, r"^ntk_haiku.kernel: params holds integer arrays, as Haiku state does", ("haiku",)),
        Row("haiku-empty-state", "an empty state for a model with BatchNorm",
            'ntk_haiku.kernel(bn_net, BP, X, state={}, apply_kwargs={"is_training": False})',
            ValueError, r"^ntk_haiku.kernel: applying the model to x1 failed: ValueError: .*\x27batch_norm/~/mean_ema\x27", ("haiku",)),
        Row("haiku-params-state-swapped", "params and state swapped (state of floats only)",
            "ntk_haiku.kernel(scale_net, SS, X, state=SP)",
            ValueError, r"^ntk_haiku.kernel: params holds the model\x27s state", ("haiku",)),
        Row("haiku-mc-bn-init", "Haiku BatchNorm Monte Carlo without init_kwargs (BatchNorm initialises only in training mode)",
            'ntk_haiku.monte_carlo_kernels(bn_net, X, key=jax.random.PRNGKey(0), n_samples=2, apply_kwargs={"is_training": False})',
            ValueError, r"^ntk_haiku.monte_carlo_kernels: transformed.init\(key, x1\) failed with ValueError", ("haiku",)),
        Row("haiku-other-model-params", "params of another Haiku model",
            "ntk_haiku.kernel(bn_net, HP, X, state=BS, apply_kwargs={'is_training': False})",
            ValueError, r"^ntk_haiku.kernel: applying the model to x1 failed: ValueError: .*\x27batch_norm\x27", ("haiku",)),
        Row("haiku-missing-model-argument", "a model argument (is_training) not given",
            "ntk_haiku.kernel(bn_net, BP, X, state=BS)",
            ValueError, r"^ntk_haiku.kernel: applying the model to x1 failed: TypeError: .*missing 1 required positional argument: 'is_training'.* flags in apply_kwargs", ("haiku",)),
        Row("haiku-inputs-kwargs-tuple", "inputs='kwargs' with x1 a tuple (Haiku)",
            'ntk_haiku.kernel(net, HP, (X,), inputs="kwargs")',
            TypeError, r"^ntk_haiku.kernel: inputs='kwargs' needs x1 as a dict of per-sample arrays, got tuple. Fix: pass a dict, inputs='args' for a tuple", ("haiku",)),
        Row("haiku-inputs-value", "inputs= none of 'x', 'args', 'kwargs' (Haiku Monte Carlo)",
            'ntk_haiku.monte_carlo_kernels(net, X, key=jax.random.PRNGKey(0), n_samples=2, inputs=None)',
            ValueError, r"^ntk_haiku.monte_carlo_kernels: inputs must be 'x', 'args' or 'kwargs', got None", ("haiku",)),
        Row("haiku-input-shape", "inputs of the wrong per-sample shape (7 features for a Linear layer initialised with 3)",
            "ntk_haiku.kernel(net, HP, jnp.ones((4, 7)))",
            ValueError, r"^ntk_haiku.kernel: applying the model to x1 failed: x1 has per-sample shape \(7,\), but params were made by transformed.init for inputs of per-sample shape \(3,\)", ("haiku",)),
        # -- batching (issue 4) -------------------------------------------------------
        Row("batch-size-zero", "batch_size=0",
            "ntk_core.empirical_ntk(f, W, X, batch_size=0)",
            ValueError, r"^empirical_ntk: batch_size must be a positive number of samples per tile, got 0"),
        Row("batch-size-negative", "a negative batch_size",
            "ntk_core.empirical_ntk(f, W, X, batch_size=-3)",
            ValueError, r"^empirical_ntk: batch_size must be a positive number of samples per tile, got -3"),
        Row("batch-size-float", "a non-integer batch_size",
            "ntk_core.empirical_ntk(f, W, X, batch_size=2.5)",
            TypeError, r"^empirical_ntk: batch_size must be None, a positive int or 'auto', got float 2.5"),
        Row("batch-size-bool", "batch_size=True",
            "ntk_core.ntk_fn(f, batch_size=True)",
            TypeError, r"^ntk_fn: batch_size must be None, a positive int or 'auto', got bool True"),
        Row("batch-size-string", "an unknown batch_size string",
            'ntk_core.ntk_fn(f, batch_size="big")',
            ValueError, r"^ntk_fn: batch_size must be None, a positive int or 'auto', got the string 'big'"),
        Row("store-on-device-type", "store_on_device that is not a bool",
            'ntk_core.ntk_fn(f, batch_size=2, store_on_device="yes")',
            TypeError, r"^ntk_fn: store_on_device must be True or False, got str 'yes'"),
        Row("memory-budget-negative", "a negative memory_budget",
            'ntk_core.ntk_fn(f, batch_size="auto", memory_budget=-1)',
            ValueError, r"^ntk_fn: memory_budget must be a positive int number of bytes, got -1"),
        Row("memory-budget-without-batch-size", "a memory_budget without a batch_size (it would change nothing)",
            "ntk_core.empirical_ntk(f, W, X, memory_budget=10**9)",
            ValueError, r"^empirical_ntk: memory_budget=1000000000 sizes the blocked engine's tiles, but batch_size is None"),
        Row("memory-budget-below-one-tile", "a memory_budget that even tiles of one sample exceed",
            'ntk_core.empirical_ntk(f, W, X, batch_size="auto", memory_budget=10)',
            ValueError, r"^empirical_ntk: memory_budget=10 bytes is below the \d+ bytes of a 1 x 1 tile"),
        # -- non-finite values (issue 4) ----------------------------------------------
        Row("nan-x1", "NaN in x1",
            "ntk_core.empirical_ntk(f, W, X.at[2, 1].set(jnp.nan))",
            NonFiniteError, r"^empirical_ntk: x1 contains NaN values, first in sample 2"),
        Row("inf-x2", "Inf in x2",
            "ntk_core.empirical_ntk(f, W, X, X.at[0, 0].set(jnp.inf))",
            NonFiniteError, r"^empirical_ntk: x2 contains Inf values, first in sample 0"),
        Row("nan-batched", "NaN in x1 of a batched call",
            "ntk_core.empirical_ntk(f, W, X.at[3, 0].set(jnp.nan), batch_size=2)",
            NonFiniteError, r"^empirical_ntk: x1 contains NaN values, first in sample 3"),
        Row("kernel-non-finite", "a kernel that overflows float32 from finite inputs",
            "ntk_core.empirical_ntk(lambda w, x: jnp.exp(50.0 * (x @ w)), W, X)",
            NonFiniteError, r"^empirical_ntk: the kernel came out non-finite \(NaN or Inf\) in the tile of x1 samples 0..3 and x2 samples 0..3"),
        Row("kernel-non-finite-batched", "a batched kernel that comes out non-finite",
            "ntk_core.empirical_ntk(lambda w, x: jnp.exp(50.0 * (x @ w)), W, X, batch_size=2)",
            NonFiniteError, r"^empirical_ntk: the kernel came out non-finite \(NaN or Inf\) in the tile of x1 samples 0..1"),
        # -- predictions (issue 5) ----------------------------------------------------
        Row("gp-target-shape", "GP inference with kernel and targets of different N",
            "ntk_core.predict.gp_inference(np.eye(4), np.ones((3, 1)))",
            ValueError, r"^gp_inference: k_train_train has shape \(4, 4\), expected \(3, 3\) for y_train of shape \(3, 1\)"),
        Row("gp-non-square", "a non-square train-train kernel",
            "ntk_core.predict.gp_inference(np.ones((4, 3)), np.ones((4, 1)))",
            ValueError, r"^gp_inference: k_train_train has shape \(4, 3\), expected \(4, 4\)"),
        Row("gp-non-symmetric", "a non-symmetric train-train kernel",
            "ntk_core.predict.gp_inference(np.eye(4) + np.triu(np.ones((4, 4)), 1), np.ones((4, 1)))",
            ValueError, r"^gp_inference: k_train_train is not symmetric: max \|K - K\^T\| = 1.000e\+00"),
        Row("gp-negative-diag-reg", "a negative diag_reg",
            "ntk_core.predict.gp_inference(np.eye(4), np.ones((4, 1)), diag_reg=-1e-3)",
            ValueError, r"^gp_inference: diag_reg must be a real number in \[0, inf\), got -0.001"),
        Row("gd-time-string", "a gradient-descent prediction time given as a string",
            "ntk_core.predict.gradient_descent_mse(np.eye(4), np.ones((4, 1)))('10')",
            TypeError, r"^gradient_descent_mse\(...\): t must be a number or a non-empty array of numbers, got str '10'"),
        Row("gd-negative-diag-reg", "a negative diag_reg in gradient-descent dynamics",
            "ntk_core.predict.gradient_descent_mse(np.eye(4), np.ones((4, 1)), diag_reg=-1.0)",
            ValueError, r"^gradient_descent_mse: diag_reg must be a real number in \[0, inf\), got -1.0"),
        Row("gp-nan-kernel", "a train-train kernel with NaN",
            "ntk_core.predict.gp_inference(np.full((4, 4), np.nan), np.ones((4, 1)))",
            NonFiniteError, r"^gp_inference: k_train_train contains NaN or Inf"),
        Row("gp-misspelt-option", "a misspelt option of gp_inference",
            "ntk_core.predict.gp_inference(np.eye(4), np.ones((4, 1)), diag_regularizer=1e-3)",
            TypeError, r"^gp_inference: unknown keyword argument\(s\) 'diag_regularizer'.* Fix: write diag_reg= \(not diag_regularizer=\)"),
        Row("eigsh-positional-k", "kernel_eigsh given k positionally (it is keyword-only)",
            "ntk_core.spectrum.kernel_eigsh(np.eye(4), 2)",
            TypeError, r"^kernel_eigsh: too many positional arguments"),
        Row("gp-test-shape", "a test-train kernel whose N_train differs",
            "ntk_core.predict.gp_inference(np.eye(4), np.ones((4, 1))).nngp(np.ones((2, 3)))",
            ValueError, r"^gp_inference\(...\).nngp: k_test_train has shape \(2, 3\), expected \(M, 4\)"),
        Row("gp-test-transposed", "a test-train kernel given train samples first (transposed)",
            "ntk_core.predict.gp_inference(np.eye(4), np.ones((4, 1))).nngp(np.ones((4, 2)))",
            ValueError, r"^gp_inference\(...\).nngp: k_test_train has shape \(4, 2\), expected \(M, 4\).* Fix: pass k_test_train with the test samples first \(axes 0 and 1 swapped\?\)"),
        Row("gp-negative-diagonal", "a train kernel with a negative mean diagonal (not a kernel) and a relative diag_reg",
            "ntk_core.predict.gp_inference(-np.eye(4), np.ones((4, 1)), diag_reg=1.0)",
            ValueError, r"^gp_inference: K \+ λI is not positive semi-definite: .*; its mean diagonal is -1.00e\+00 <= 0\. Fix: pass a kernel \(not a difference of two\), or diag_reg_absolute_scale=True with diag_reg > 1.0e\+00"),
        Row("batch-size-under-jit", "a batched kernel function called inside jax.jit",
            "jax.jit(ntk_core.ntk_fn(f, batch_size=2))(W, X)",
            ValueError, r"^ntk_fn: batch_size=2 was used inside jax.jit"),
        Row("scalar-output-default-trace", "a model returning one value per sample (N,) with the default trace_axes",
            "ntk_core.empirical_ntk(lambda w, x: jnp.tanh(x @ w).sum(-1), W, X)",
            ValueError, r"^empirical_ntk: trace_axes=\(-1,\) traces the batch axis 0 of the output of shape \(4,\)"),
        Row("python-branch-on-values", "a Python if on a value of x (traced under vmap)",
            "ntk_core.empirical_ntk(lambda w, x: x @ w if x.sum() > 0 else -(x @ w), W, X)",
            ValueError, r"^empirical_ntk: calling the model on x1 .* failed with TracerBoolConversionError: .*Fix: branch with jnp.where or lax.cond"),
        Row("outputs-and-loss", "a model returning (outputs, a per-sample loss)",
            "ntk_core.empirical_ntk(lambda w, x: (x @ w, jnp.sum((x @ w) ** 2, -1)), W, X)",
            ValueError, r"^empirical_ntk: trace_axes=\(-1,\) traces the batch axis 0 of output leaf 1 of shape \(4,\).* or make the model return its outputs alone"),
        Row("gp-nan-targets", "targets with NaN (missing labels)",
            "ntk_core.predict.gp_inference(np.eye(4), np.array([[1.0], [np.nan], [0.0], [2.0]]))",
            NonFiniteError, r"^gp_inference: y_train contains NaN or Inf"),
        # -- gradient_descent_mse_ensemble: predictions from a kernel_fn (issue 49) ------
        Row("ensemble-kernel-fn", "gradient_descent_mse_ensemble given a kernel matrix, not a kernel_fn",
            "ntk_core.predict.gradient_descent_mse_ensemble(np.eye(4), X, np.ones((4, 1)))",
            TypeError, r"^gradient_descent_mse_ensemble: kernel_fn must be callable, got ndarray\. Fix:"),
        Row("ensemble-samples", "x_train and y_train of different N",
            "ntk_core.predict.gradient_descent_mse_ensemble(lambda x1, x2=None, get=None: np.eye(4), X, np.ones((3, 1)))",
            ValueError, r"^gradient_descent_mse_ensemble: x_train has 4 samples but y_train has 3"),
        Row("ensemble-misspelt-option", "a misspelt option (it would go to kernel_fn as a keyword)",
            "ntk_core.predict.gradient_descent_mse_ensemble(lambda x1, x2=None, get=None: np.eye(4), X, np.ones((4, 1)), diag_regg=1e-3)",
            TypeError, r"^gradient_descent_mse_ensemble: kernel_fn\(x1, x2=None, get=None\) cannot be called as kernel_fn\(x1, x2, get, diag_regg=\.\.\.\).* Fix: write diag_reg= \(not diag_regg=\)"),
        Row("ensemble-get", "a get= other than 'nngp' and 'ntk' (neural-tangents' 'ntkgp')",
            "ntk_core.predict.gradient_descent_mse_ensemble(lambda x1, x2=None, get=None: np.eye(4), X, np.ones((4, 1)))(get='ntkgp')",
            ValueError, r"^gradient_descent_mse_ensemble\(\.\.\.\): get must name 'nngp' and/or 'ntk', got 'ntkgp'"),
        Row("ensemble-kernel-shape", "a kernel_fn whose train-train kernel does not match x_train",
            "ntk_core.predict.gradient_descent_mse_ensemble(lambda x1, x2=None, get=None: np.eye(3), X, np.ones((4, 1)))(get='nngp')",
            ValueError, r"^gradient_descent_mse_ensemble: kernel_fn\(x_train, None, get='nngp'\) has shape \(3, 3\), expected \(4, 4\)"),
        Row("ensemble-kernel-tuple", "a kernel_fn returning one array when asked for get=('nngp', 'ntk')",
            "ntk_core.predict.gradient_descent_mse_ensemble(lambda x1, x2=None, get=None: np.eye(4), X, np.ones((4, 1)))()",
            TypeError, r"^gradient_descent_mse_ensemble: kernel_fn\(x_train, None, get=\('nngp', 'ntk'\)\) returned ndarray, expected \.nngp and \.ntk or a 2-tuple"),
        # -- tracking through training (issue 18) -------------------------------------
        Row("tracker-every-zero", "a KernelTracker with every=0",
            "ntk_core.KernelTracker(ntk_core.ntk_fn(f), X, every=0)",
            ValueError, r"^KernelTracker: every must be a positive int, got 0"),
        Row("tracker-every-float", "a KernelTracker with every not an int",
            "ntk_core.KernelTracker(ntk_core.ntk_fn(f), X, every=2.5)",
            TypeError, r"^KernelTracker: every must be a positive int, got 2.5 \(float\)"),
        Row("tracker-not-callable", "a KernelTracker given params instead of a kernel function",
            "ntk_core.KernelTracker(W, X, every=1)",
            TypeError, r"^KernelTracker: kernel_fn must be a callable kernel\(params_like, x\), got ArrayImpl"),
        Row("tracker-probe-no-batch-axis", "a KernelTracker probe set without a batch axis",
            "ntk_core.KernelTracker(ntk_core.ntk_fn(f), jnp.float32(1.0), every=1)",
            ValueError, r"^KernelTracker: x_probe must hold arrays of one size N >= 1 on axis 0, got shapes \[\(\)\]"),
        Row("tracker-probe-not-array", "a KernelTracker probe set of Python numbers",
            "ntk_core.KernelTracker(ntk_core.ntk_fn(f), [1.0, 2.0], every=1)",
            TypeError, r"^KernelTracker: x_probe must be an array or a pytree of arrays, got a leaf of type float"),
        Row("tracker-y-length", "KernelTracker labels for another number of samples",
            "ntk_core.KernelTracker(ntk_core.ntk_fn(f), X, jnp.ones((3, 2)), every=1)",
            ValueError, r"^KernelTracker: y has shape \(3, 2\), not \(4,\) or \(4, O\)"),
        Row("tracker-m-too-few", "a matrix-free KernelTracker with fewer products than its Lanczos needs",
            "ntk_core.KernelTracker(ntk_core.ntk_fn(f), jnp.ones((40, 3)), every=1, m=8, steps=1, key=jax.random.PRNGKey(0))",
            ValueError, r"^KernelTracker: m must be an int >= 24, got 8"),
        Row("tracker-out-not-a-folder", "a KernelTracker writing under a file, not a folder",
            "ntk_core.KernelTracker(ntk_core.ntk_fn(f), X, every=1, out='/dev/null/kernels')",
            ValueError, r"^KernelTracker: out='/dev/null/kernels' cannot be used as a folder"),
        Row("tracker-step-jax-array", "KernelTracker.update with a jax.Array step (state.step)",
            "ntk_core.KernelTracker(ntk_core.ntk_fn(f), X, every=1).update(jnp.array(0), W)",
            TypeError, r"^KernelTracker.update: step is a jax.Array .* would wait for the device"),
        Row("tracker-apply-fn-as-kernel", "a KernelTracker given the model's apply function, not a kernel function",
            "ntk_core.KernelTracker(f, X, every=1).update(0, W)",
            ValueError, r"^KernelTracker.update: the kernel function returned shape \(4, 2\); expected \(4, 4, \.\.\.\)"),
        # -- parameter subsets, wrt= (issue 27) ---------------------------------------
        Row("wrt-type", "wrt neither None, a predicate nor path names",
            "ntk_core.empirical_ntk(mlp, P, X, wrt=3)",
            TypeError, r"^empirical_ntk: wrt must be None, a predicate wrt\(path\) -> bool, or a path name"),
        Row("wrt-empty", "wrt=[] (no name at all)",
            "ntk_core.empirical_ntk(mlp, P, X, wrt=[])",
            ValueError, r"^empirical_ntk: wrt=\[\] selects no parameter"),
        Row("wrt-unknown-name", "wrt naming a parameter the model does not have (a typo)",
            'ntk_core.empirical_ntk(mlp, P, X, wrt="vv")',
            ValueError, r"^empirical_ntk: wrt names 'vv', which no parameter has. Fix: write 'v'"),
        Row("wrt-selects-none", "a wrt predicate that is false for every leaf",
            'ntk_core.empirical_ntk(mlp, P, X, wrt=lambda path: path[-1] == "bias")',
            ValueError, r"^empirical_ntk: wrt selects none of the 2 parameter leaves, whose paths are \('v',\)"),
        Row("wrt-predicate-fails", "a wrt predicate that fails on a path (here: an int key)",
            "ntk_core.empirical_ntk(mlp, [P, P], X, wrt=lambda path: path[0].startswith('w'))",
            TypeError, r"^empirical_ntk: wrt\(path\) raised AttributeError: .* on the path \(0, 'v'\)"),
        Row("wrt-predicate-not-bool", "a wrt predicate returning something else than a bool",
            "ntk_core.empirical_ntk(mlp, P, X, wrt=lambda path: 'yes')",
            TypeError, r"^empirical_ntk: wrt\(path\) raised TypeError: it returned str 'yes', not a bool"),
        Row("wrt-tuple-as-path", "a path given as a tuple of keys (read as several names)",
            'ntk_core.empirical_ntk(mlp, {"l": P}, X, wrt=("l", "v"))',
            ValueError, r"^empirical_ntk: wrt names 'v', which no parameter has. Fix: write 'l/v': a list or tuple is several names"),
        Row("wrt-nngp", "wrt= given to an NNGP function (outputs have no parameter subset)",
            "ntk_core.empirical_nngp(mlp, P, X, wrt='v')",
            TypeError, r"^empirical_nngp: unknown keyword argument\(s\) 'wrt'.*Fix: drop wrt= \(the NNGP takes no derivative"),
        Row("wrt-flax-unknown", "a Flax path that the params collection does not have",
            "ntk_flax.kernel(dense, V, X, wrt='Dense_0')",
            ValueError, r"^ntk_flax.kernel: wrt names 'Dense_0', which no parameter has", ("flax",)),
        # -- low-rank predictions from features (issue 27) ----------------------------
        Row("low-rank-test-k", "test features with another k than the train features",
            "ntk_core.predict.low_rank_inference(np.eye(4, 2), np.ones(4)).posterior(np.ones((3, 5)))",
            ValueError, r"^low_rank_inference\(...\).posterior: features_test has shape \(3, 5\), expected \(M, 2\)"),
        Row("low-rank-target-n", "low-rank targets for another number of samples",
            "ntk_core.predict.low_rank_inference(np.eye(4, 2), np.ones((3, 1)))",
            ValueError, r"^low_rank_inference: y_train has shape \(3, 1\), expected \(N,\) or \(N, O >= 1\) with N = 4"),
        Row("low-rank-negative-diag-reg", "a negative diag_reg for low-rank predictions",
            "ntk_core.predict.low_rank_inference(np.eye(4, 2), np.ones(4), diag_reg=-1.0)",
            ValueError, r"^low_rank_inference: diag_reg must be a real number in \[0, inf\), got -1.0"),
        Row("low-rank-nan-features", "features with NaN",
            "ntk_core.predict.low_rank_inference(np.full((4, 2), np.nan), np.ones(4))",
            NonFiniteError, r"^low_rank_inference: features_train contains NaN or Inf \(first at sample 0\)"),
        Row("low-rank-singular", "dependent feature columns without a regulariser",
            "ntk_core.predict.low_rank_inference(np.ones((4, 2)), np.ones(4))",
            ValueError, r"^low_rank_inference: ΦᵀΦ \+ λI \(k = 2, λ = 0.000e\+00, N = 4\) is singular to float64"),
        Row("low-rank-overflow", "features so large that ΦᵀΦ overflows float64",
            "ntk_core.predict.low_rank_inference(np.full((4, 2), 1e200), np.ones(4))",
            NonFiniteError, r"^low_rank_inference: ΦᵀΦ \(summed in float64\) contains NaN or Inf .* Fix: rescale the features"),
        Row("low-rank-no-outputs", "low-rank targets with no output column",
            "ntk_core.predict.low_rank_inference(np.eye(4, 2), np.ones((4, 0)))",
            ValueError, r"^low_rank_inference: y_train has shape \(4, 0\), expected \(N,\) or \(N, O >= 1\)"),
        Row("low-rank-zero-features", "all-zero features with a relative diag_reg",
            "ntk_core.predict.low_rank_inference(np.zeros((4, 2)), np.ones(4), diag_reg=1e3)",
            ValueError, r"^low_rank_inference: features_train is all zeros and λ = 0 \(relative diag_reg\)"),
        Row("low-rank-zero-features-absolute", "all-zero features with an absolute diag_reg of 0",
            "ntk_core.predict.low_rank_inference(np.zeros((4, 2)), np.ones(4), diag_reg_absolute_scale=True)",
            ValueError, r"^low_rank_inference: features_train is all zeros and λ = 0 \(absolute diag_reg\).* Fix: pass non-zero features, or diag_reg > 0"),
        Row("predict-absolute-scale-string", "diag_reg_absolute_scale given as a string (always truthy)",
            "ntk_core.predict.gp_inference(np.eye(3), np.ones(3), diag_reg=1e-3, diag_reg_absolute_scale='no')",
            TypeError, r"^gp_inference: diag_reg_absolute_scale must be True or False, got 'no' \(str\)"),
        Row("gp-test-prior-asymmetric", "a full test-test prior that is not symmetric",
            "ntk_core.predict.gp_inference(np.eye(4), np.ones((4, 1))).nngp(np.ones((2, 4)), np.array([[1.0, 0.5], [0.0, 1.0]]))",
            ValueError, r"^gp_inference\(...\).nngp: k_test_test is not symmetric: max \|K - K\^T\| = 5.000e-01"),
        Row("low-rank-test-prior-asymmetric", "a full test-test prior of the low-rank posterior that is not symmetric",
            "ntk_core.predict.low_rank_inference(np.eye(4, 2), np.ones(4)).posterior(np.eye(2), np.array([[9.0, 5.0], [0.0, 9.0]]), full_covariance=True)",
            ValueError, r"^low_rank_inference\(...\).posterior: k_test_test is not symmetric: max \|K - K\^T\| = 5.000e\+00"),
        Row("low-rank-absolute-scale-string", "diag_reg_absolute_scale given as a string to the low-rank fit",
            "ntk_core.predict.low_rank_inference(np.eye(4, 2), np.ones(4), diag_reg_absolute_scale='yes')",
            TypeError, r"^low_rank_inference: diag_reg_absolute_scale must be True or False, got 'yes'"),
        Row("pntk-trace-axes", "trace_axes given to the pseudo-NTK (one output per sample)",
            "ntk_core.pntk_fn(f, trace_axes=())",
            TypeError, r"^pntk_fn: unknown keyword argument\(s\) 'trace_axes'; valid options are diagonal_axes"),
        Row("pntk-not-callable", "a pseudo-NTK of something that is not a function",
            "ntk_core.empirical_pntk(W, W, X)",
            TypeError, r"^empirical_pntk: apply_fn must be a callable apply_fn\(params, x\)"),
        # -- matrix-free statistics (ntk_core.spectrum.ntk_*) --------------------------
        Row("matrix-free-m-zero", "a matrix-free estimate with m <= 0 products",
            "ntk_core.spectrum.ntk_frobenius_sq(f, W, XS, key=jax.random.PRNGKey(0), m=0)",
            ValueError, r"^ntk_frobenius_sq: m must be an int >= 4, got 0"),
        Row("matrix-free-key-not-key", "a matrix-free estimate with a seed instead of a JAX key",
            "ntk_core.spectrum.ntk_frobenius_sq(f, W, XS, key=0)",
            TypeError, r"^ntk_frobenius_sq: key must be one JAX PRNG key, got int"),
        Row("matrix-free-keys", "a matrix-free estimate with several keys (split) as key",
            "ntk_core.spectrum.ntk_effective_rank(f, W, XS, key=jax.random.split(jax.random.PRNGKey(0)))",
            TypeError, r"^ntk_effective_rank: key must be one JAX PRNG key, got ArrayImpl of shape \(2, 2\)"),
        Row("matrix-free-steps-zero", "a matrix-free effective rank with steps=0 Lanczos steps",
            "ntk_core.spectrum.ntk_effective_rank(f, W, XS, key=jax.random.PRNGKey(0), steps=0)",
            ValueError, r"^ntk_effective_rank: steps must be a positive int, got 0"),
        Row("matrix-free-y-shape", "matrix-free alignment with targets for another number of samples",
            "ntk_core.spectrum.ntk_kernel_alignment(f, W, XS, jnp.ones((3, 2)), key=jax.random.PRNGKey(0))",
            ValueError, r"^ntk_kernel_alignment: y has shape \(3, 2\); expected the outputs' shape \(4, 2\)"),
        Row("matrix-free-nan-model", "a model whose gradients are NaN at these params (sqrt of a negative)",
            "ntk_core.spectrum.ntk_frobenius_sq(lambda w, x: jnp.sqrt(x @ w - 10.0), W, XS, key=jax.random.PRNGKey(0))",
            NonFiniteError, r"^ntk_frobenius_sq: an NTK-vector product Θ v contains NaN or Inf"),
        Row("matrix-free-wrt-unknown", "a matrix-free statistic of a subset naming no parameter",
            'ntk_core.spectrum.ntk_trace(mlp, P, X, wrt="vv")',
            ValueError, r"^ntk_trace: wrt names 'vv', which no parameter has\. Fix: write 'v'"),
        Row("matrix-free-kernel-option", "an adapter's statistic given a kernel option it does not read",
            "ntk_flax.ntk_trace(dense, V, X, trace_axes=())",
            TypeError, r"^ntk_flax.ntk_trace: trace_axes=\(\) is a kernel option that ntk_flax.ntk_trace does not take", ("flax",)),
        # -- KernelTracker(m=): matrix-free tracking --------------------------------
        Row("tracker-key-without-m", "a KernelTracker given a key but no m (the exact kernel)",
            "ntk_core.KernelTracker(ntk_core.ntk_fn(f), X, every=1, key=jax.random.PRNGKey(0))",
            ValueError, r"^KernelTracker: key is given but m is None"),
        Row("tracker-matrix-free-keep-kernels", "matrix-free tracking asked to keep kernels it never forms",
            "ntk_core.KernelTracker(ntk_core.ntk_fn(f), X, every=1, m=60, key=jax.random.PRNGKey(0), keep_kernels=True)",
            ValueError, r"^KernelTracker: keep_kernels=True with m=60: matrix-free tracking forms no kernel"),
        Row("tracker-matrix-free-traced", "matrix-free tracking of a kernel function with traced outputs",
            "ntk_core.KernelTracker(ntk_core.ntk_fn(f), X, every=1, m=60, key=jax.random.PRNGKey(0)).update(0, W)",
            ValueError, r"^KernelTracker.update: matrix-free tracking needs the full kernel, got trace_axes=\(-1,\)"),
        Row("tracker-matrix-free-not-ntk", "matrix-free tracking of something that is not an NTK kernel function",
            "ntk_core.KernelTracker(ntk_core.nngp_fn(f, trace_axes=()), X, every=1, m=60, key=jax.random.PRNGKey(0)).update(0, W)",
            TypeError, r"^KernelTracker.update: matrix-free tracking reads the model from an NTK kernel function, got KernelFunction of kind 'nngp'"),
        Row("tracker-m-any-outputs", "a matrix-free KernelTracker with fewer products than any number of outputs O allows (O unknown before the first update)",
            "ntk_core.KernelTracker(ntk_core.ntk_fn(f, trace_axes=()), X, every=1, m=3, key=jax.random.PRNGKey(0))",
            ValueError, r"^KernelTracker: m must be an int >= 4, got 3: .* = min\(248, 4·O\) NTK-vector products, O .* known only at the first update\. Fix: pass m >= 248 \(enough for any O\)"),
        Row("tracker-m-these-outputs", "a matrix-free KernelTracker with fewer products than the model's O outputs need (known at the first update)",
            "ntk_core.KernelTracker(ntk_core.ntk_fn(f, trace_axes=()), X, every=1, m=6, key=jax.random.PRNGKey(0)).update(0, W)",
            ValueError, r"^KernelTracker.update: m must be an int >= 8, got 6: .* = min\(248, 4·2\) NTK-vector products; O is known only now"),
        Row("tracker-top-k-over-eigenvalues", "a KernelTracker asking for more eigenvalues than the kernel has (N·O, known at the first update)",
            "ntk_core.KernelTracker(ntk_core.ntk_fn(f), X, every=1, top_k=5).update(0, W)",
            ValueError, r"^KernelTracker.update: top_k must be an int in \[1, 4\], got 5: the kernel has N·O = 4·1 eigenvalues .*Fix: pass top_k <= 4"),
        Row("tracker-update-swapped", "KernelTracker.update given (params, step)",
            "ntk_core.KernelTracker(ntk_core.ntk_fn(f), X, every=1).update(W, 0)",
            TypeError, r"^KernelTracker.update: params_like is the int 0 and step a .*: the arguments look swapped\. Fix: call update\(step, params_like\)"),
        Row("tracker-one-call-function", "a KernelTracker given empirical_ntk, not a kernel function",
            "ntk_core.KernelTracker(ntk_core.empirical_ntk, X, every=1)",
            TypeError, r"^KernelTracker: kernel_fn must be a callable kernel\(params_like, x\), got empirical_ntk"),
        Row("tracker-probe-nan", "a KernelTracker whose probe samples hold NaN",
            "ntk_core.KernelTracker(ntk_core.ntk_fn(f), X.at[2, 0].set(jnp.nan), every=1)",
            NonFiniteError, r"^KernelTracker: x_probe contains NaN values, first in sample 2"),
        # -- NaN parameters, swapped Monte Carlo functions, zero and odd GP inputs -------
        Row("params-nan", "weights that went NaN in training",
            "ntk_core.empirical_ntk(f, W.at[0, 1].set(jnp.nan), X)",
            NonFiniteError, r"^empirical_ntk: params contains NaN or Inf\. Fix: check the training step"),
        Row("params-nan-blocked", "weights that went NaN in training, in tiles",
            "ntk_core.empirical_ntk(mlp, {'w': P['w'], 'v': P['v'].at[1, 1].set(jnp.inf)}, X, batch_size=2)",
            NonFiniteError, r"^empirical_ntk: params\['v'\] contains NaN or Inf"),
        Row("output-with-aux", "a model returning (outputs, aux), as a loss function might",
            "ntk_core.empirical_ntk(lambda w, x: (x @ w, jnp.sum(w)), W, X)",
            ValueError, r"^empirical_ntk: output leaf 1 has shape \(\) but x1 has 4 samples.* Fix: make apply_fn return its outputs alone"),
        Row("linearized-swapped", "a linearised model called as (x, params)",
            "ntk_core.linearize(mlp, P)(X, P)",
            ValueError, r"^linearize: the second argument has the structure of the expansion point \(params0\), params not\. Fix: call it as \(params, x\)"),
        Row("monte-carlo-swapped", "monte_carlo_kernels given (apply_fn, init_fn)",
            "ntk_core.monte_carlo_kernels(f, lambda k: W, X, key=jax.random.PRNGKey(0), n_samples=2)",
            TypeError, r"^monte_carlo_kernels: init_fn takes 2 arguments and apply_fn 1: they look swapped"),
        Row("gp-zero-kernel", "a GP on an all-zero kernel (outputs that do not depend on the parameters)",
            "ntk_core.predict.gp_inference(np.zeros((4, 4)), np.ones((4, 1)))",
            ValueError, r"^gp_inference: K \+ λI is singular: the kernel is all zeros"),
        Row("gp-fit-amplitude-string", "fit_amplitude given as a string",
            "ntk_core.predict.gp_inference(np.eye(4), np.ones((4, 1)), fit_amplitude='no')",
            TypeError, r"^gp_inference: fit_amplitude must be True or False, got 'no'"),
        # -- the sketched eNTK (ntk_core.ntk_sketch_fn, empirical_ntk_sketch) -----------
        Row("sketch-k-zero", "a sketch of size k <= 0",
            "ntk_core.ntk_sketch_fn(f, k=0, key=jax.random.PRNGKey(0))",
            ValueError, r"^ntk_sketch_fn: k must be a positive int, got 0"),
        Row("sketch-k-huge", "a sketch size beyond the hash range",
            "ntk_core.ntk_sketch_fn(f, k=2**31, key=jax.random.PRNGKey(0))",
            ValueError, r"^ntk_sketch_fn: k must be below 2\*\*31, got 2147483648"),
        Row("sketch-k-float", "a sketch size that is not an int",
            "ntk_core.ntk_sketch_fn(f, k=512.0, key=jax.random.PRNGKey(0))",
            TypeError, r"^ntk_sketch_fn: k must be a positive int, got 512.0 \(float\)"),
        Row("sketch-key-not-key", "a sketch with a seed instead of a JAX key",
            "ntk_core.empirical_ntk_sketch(f, W, X, k=64, key=0)",
            TypeError, r"^empirical_ntk_sketch: key must be one JAX PRNG key, got int"),
        Row("sketch-float16", "a sketch asked of a float16 model",
            "ntk_core.empirical_ntk_sketch(f, W.astype(jnp.float16), X.astype(jnp.float16), k=64, key=jax.random.PRNGKey(0))",
            ValueError, r"^empirical_ntk_sketch: the model computes in float16; .* Fix: cast params and x to float32"),
        Row("sketch-two-outputs", "a sketch of a model with several output arrays",
            "ntk_core.empirical_ntk_sketch(lambda w, x: (x @ w, x @ w), W, X, k=64, key=jax.random.PRNGKey(0))",
            ValueError, r"^empirical_ntk_sketch: apply_fn returned 2 output arrays; the sketch takes one"),
        Row("sketch-samples-interact", "a sketch of a model whose samples interact (batch mean)",
            "ntk_core.empirical_ntk_sketch(centred, W, XS, k=64, key=jax.random.PRNGKey(0))",
            ValueError, r"^empirical_ntk_sketch: the model's output for one sample depends on the other samples"),
        Row("sketch-out-without-batch-size", "sketch features to a file without blocks",
            'ntk_core.ntk_sketch_fn(f, k=64, key=jax.random.PRNGKey(0), out="phi.npy")',
            ValueError, r"^ntk_sketch_fn: out='phi.npy' writes blocks of rows to a file, but batch_size is None"),
        Row("sketch-resume-without-out", "resume=True for sketch features kept in memory",
            "ntk_core.ntk_sketch_fn(f, k=64, key=jax.random.PRNGKey(0), resume=True)",
            ValueError, r"^ntk_sketch_fn: resume=True applies to the file of out=, but out is None"),
        Row("sketch-resume-another-key", "resume=True on the features file of another key",
            '[ntk_core.ntk_sketch_fn(f, k=64, key=jax.random.PRNGKey(seed), batch_size=2, out=path, resume=True)(W, X) for path in [__import__("tempfile").mkdtemp() + "/phi.npy"] for seed in (0, 1)]',
            ValueError, r"^ntk_sketch_fn: resume=True, but .*phi\.npy' was started by a different call: key differ"),
        Row("sketch-features-keyword", "the core's sketch features called with a keyword argument",
            "ntk_core.ntk_sketch_fn(f, k=64, key=jax.random.PRNGKey(0))(W, X, rngs=None)",
            TypeError, r"^ntk_sketch_fn\(...\)\(...\): unknown keyword argument\(s\) 'rngs'"),
        Row("sketch-features-no-x", "the sketch features called without x",
            "ntk_core.ntk_sketch_fn(f, k=64, key=jax.random.PRNGKey(0))(W)",
            TypeError, r"^ntk_sketch_fn\(...\)\(...\): missing a required argument: 'x'"),
        Row("sketch-adapter-kernel-option", "an adapter's sketch given a kernel option it does not read",
            "ntk_flax.ntk_sketch(dense, V, X, k=64, key=jax.random.PRNGKey(0), implementation='jacobian')",
            TypeError, r"^ntk_flax.ntk_sketch: implementation='jacobian' is a kernel option that ntk_flax.ntk_sketch does not take", ("flax",)),
        Row("sketch-adapter-batch-string", "an adapter's sketch given a batch_size string other than 'auto'",
            "ntk_haiku.ntk_sketch_fn(net, k=64, key=jax.random.PRNGKey(0), batch_size='big')",
            ValueError, r"^ntk_haiku.ntk_sketch_fn: batch_size must be None, a positive int or 'auto', got the string 'big'", ("haiku",)),
        Row("sketch-key-float-pair", "a float pair of the right shape given as a JAX key",
            "ntk_core.ntk_sketch_fn(f, k=64, key=jnp.array([0.0, 1.0]))",
            TypeError, r"^ntk_sketch_fn: key must be one JAX PRNG key, got ArrayImpl of shape \(2,\), dtype float32"),
        Row("linearized-inputs-wrong-shape", "a linearised model called on inputs of another feature size",
            "ntk_core.linearize(mlp, P)(P, jnp.ones((4, 5)))",
            ValueError, r"^linearize: calling the model on its inputs failed with TypeError: .*Fix: give x as the model takes it at the expansion point"),
        Row("equinox-linearize-other-model", "f_lin of ntk_equinox.linearize called with a model of another shape",
            "ntk_equinox.linearize(eqx_lin)(eqx.nn.Linear(3, 4, key=jax.random.PRNGKey(1)), X)",
            ValueError, r"^ntk_equinox.linearize: the model's structure or fixed fields differ from model0's\. Fix: pass model0 with new weights", ("equinox",)),
        Row("linearize-nan-point", "an expansion point holding NaN (a diverged training step)",
            "ntk_core.linearize(f, W.at[0, 0].set(jnp.nan))",
            NonFiniteError, r"^linearize: params0 contains NaN or Inf\. Fix: expand around finite parameters"),
        Row("sketch-kernel-too-large", "the N1 x N2 sketched kernel of 1 000 000 samples (4 TB)",
            "ntk_core.empirical_ntk_sketch(f, W, jnp.ones((1_000_000, 3)), k=8, key=jax.random.PRNGKey(0))",
            ValueError, r"^empirical_ntk_sketch: the sketched kernel Θ̂ of 1000000 x 1000000 samples is .*Fix: use the features Φ"),
        Row("sketch-nan-features", "a model whose gradients are NaN at some samples (sqrt of a negative), sketched",
            "ntk_core.ntk_sketch_fn(lambda w, x: jnp.sqrt(7.0 - x @ w), k=8, key=jax.random.PRNGKey(0), batch_size=2)(W, XS)",
            NonFiniteError, r"^ntk_sketch_fn: the sketched features Φ came out NaN or Inf at x sample 2\. Fix: check the model"),
        Row("x-shape-dtype-struct", "a jax.ShapeDtypeStruct as x1, to plan a large N without allocating it",
            "ntk_core.plan(f, W, jax.ShapeDtypeStruct((10**7, 3), jnp.float32))",
            TypeError, r"^plan: x1 is a jax\.ShapeDtypeStruct, a shape without values: \(10000000, 3\)\. Fix: pass arrays"),
        Row("params-shape-dtype-struct", "a jax.ShapeDtypeStruct as params",
            "ntk_core.empirical_ntk(f, jax.ShapeDtypeStruct((3, 2), jnp.float32), X)",
            TypeError, r"^empirical_ntk: params is a jax\.ShapeDtypeStruct, a shape without values: \(3, 2\)\. Fix: pass arrays"),
        Row("gp-empty-train", "GP inference on an empty training set (N = 0)",
            "ntk_core.predict.gp_inference(np.zeros((0, 0)), np.zeros((0, 1)))",
            ValueError, r"^gp_inference: y_train of shape \(0, 1\) is empty\. Fix: pass at least one training sample"),
        Row("taylor-degree-too-high", "a Taylor degree whose 2^d nested JVP streams never finish tracing",
            "ntk_core.taylor_expand(f, W, 30)",
            ValueError, r"^taylor_expand: degree must be an int in \[0, 10\], got 30\. Fix: .*each degree doubles the cost"),
        Row("sketch-kernel-overflow", "finite sketched features whose products overflow float32 in the sketched kernel",
            "ntk_core.empirical_ntk_sketch(lambda w, x: jnp.exp(x @ w), W, XS * 4, k=8, key=jax.random.PRNGKey(0))",
            NonFiniteError, r"^empirical_ntk_sketch: the sketched kernel Θ̂ overflowed to Inf at x1 sample 2 and x2 sample 3\. Fix:"),
        Row("gp-no-test-samples", "a test-train kernel with no test samples (0 rows)",
            "ntk_core.predict.gp_inference(np.eye(3), np.ones((3, 1))).nngp(np.zeros((0, 3)))",
            ValueError, r"^gp_inference\(\.\.\.\)\.nngp: k_test_train of shape \(0, 3\) has no test samples\. Fix:"),
        Row("ntk-vp-shape-dtype-struct", "a jax.ShapeDtypeStruct as the x of NTK-vector products",
            "ntk_core.ntk_vp_fn(f, W, jax.ShapeDtypeStruct((4, 3), jnp.float32))",
            TypeError, r"^ntk_vp_fn: x is a jax\.ShapeDtypeStruct, a shape without values: \(4, 3\)\. Fix: pass arrays"),
        Row("mc-shape-dtype-struct", "a jax.ShapeDtypeStruct as x1 of Monte Carlo kernels",
            "ntk_core.monte_carlo_kernels(lambda k: P, mlp, jax.ShapeDtypeStruct((4, 3), jnp.float32), key=jax.random.PRNGKey(0), n_samples=2)",
            TypeError, r"^monte_carlo_kernels: x1 is a jax\.ShapeDtypeStruct, a shape without values"),
        Row("embedding-id-outside", "a token id outside the embedding table (JAX would clamp it forward and drop its gradient)",
            "ntk_core.empirical_ntk(embed, E, jnp.array([[0, 1], [2, 12]]))",
            ValueError, r"^empirical_ntk: x1 sample 1 holds the id 12, outside \[-10, 10\) for the 10 rows of params\['e'\]\. Fix:"),
        # -- infinite-width kernels of Flax, Haiku and equinox models (issue 50) ------
        Row("infinite-flax-init-not-centred", "a Flax layer whose kernel_init draws entries of non-zero mean (jax's uniform: [0, scale))",
            "ntk_flax.infinite_kernel_fn(nn.Dense(2, kernel_init=nn.initializers.uniform()), V)(X)",
            ValueError, r"^ntk_flax\.infinite_kernel_fn: the weight 'kernel' \(kernel_init of the model\) has no known prior: jax\.nn\.initializers\.uniform draws in \[0, scale\): its entries are not centred\. Fix: pass W_std=\{'kernel': <its std>\}", ("flax",)),
        Row("infinite-nnx-bias-not-zero", "an nnx layer whose bias is not zero (nnx modules keep no initialisers)",
            "ntk_flax.infinite_kernel_fn(nnx.Linear(3, 2, bias_init=nnx.initializers.normal(), rngs=nnx.Rngs(0)))",
            ValueError, r"^ntk_flax\.infinite_kernel_fn: the bias 'bias' \(the model\) has no known prior: nnx modules do not keep their bias_init.*Fix: pass b_std=\{'bias': <its std>\}", ("flax",)),
        Row("infinite-nnx-variables", "variables given with an nnx module",
            "ntk_flax.infinite_kernel_fn(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), V)",
            TypeError, r"^ntk_flax\.infinite_kernel_fn: variables must be None for an nnx module", ("flax",)),
        Row("infinite-haiku-state", "an hk.TransformedWithState (its state has no infinite-width rule)",
            "ntk_haiku.infinite_kernel_fn(bn_net, BP)",
            TypeError, r"^ntk_haiku\.infinite_kernel_fn: an hk\.TransformedWithState's state .* has no rule", ("haiku",)),
        Row("infinite-haiku-custom-init", "a Haiku parameter created by a plain function (no known variance)",
            "ntk_haiku.infinite_kernel_fn(hk.transform(lambda x: hk.Linear(2, w_init=jnp.ones)(x)), HP)(X)",
            ValueError, r"^ntk_haiku\.infinite_kernel_fn: the weight 'linear/w' \(w_init of Linear 'linear'\) has no known prior: .*Fix: pass W_std=\{'linear/w': <its std>\}", ("haiku",)),
        Row("infinite-std-type", "W_std neither a float nor a Mapping",
            'ntk_equinox.infinite_kernel_fn(eqx_lin, W_std="1.5")',
            TypeError, r"^ntk_equinox\.infinite_kernel_fn: W_std must be a float or a Mapping from a weight leaf's path to a float, got str\. Fix:", ("equinox",)),
        # -- infinite-width kernels (ntk_core.stax) -----------------------------------
        Row("stax-two-nonlinearities", "two stacked nonlinearities (the second's input is not Gaussian)",
            "stax.serial(stax.Dense(3), stax.Relu(), stax.Erf())[2](X)",
            ValueError, r"^kernel_fn: Erf\(1, 1, 0\)'s input must be Gaussian \(an affine layer's output\), not Relu\(\)'s\. Fix: insert a Dense or Conv layer between Relu\(\) and Erf"),
        Row("stax-float16", "float16 inputs to an infinite-width kernel",
            "stax.serial(stax.Dense(3), stax.Relu())[2](X.astype(jnp.float16))",
            TypeError, r"^kernel_fn: x1 is float16, which cannot hold .*Fix: pass x1\.astype\('float32'\)"),
        Row("stax-conv-rank", "a 2-D convolution on inputs without spatial axes",
            "stax.serial(stax.Conv(3, (3, 3)), stax.Relu())[2](X)",
            ValueError, r"^kernel_fn: Conv acts on 2 spatial axes, but its input has 0 \(\(\)\)\. Fix:"),
        Row("stax-x-rank", "inputs without a channel axis",
            "stax.serial(stax.Dense(3))[2](jnp.ones(4))",
            ValueError, r"^kernel_fn: x1 must have a batch and a channel axis, shape \(N, \.\.\., C\), got shape \(4,\)"),
        Row("stax-nan-input", "an input sample holding NaN",
            "stax.serial(stax.Dense(3), stax.Relu())[2](X.at[1, 0].set(jnp.nan))",
            NonFiniteError, r"^kernel_fn: x1\[1\] holds NaN or Inf\. Fix: drop or fix sample 1"),
        Row("stax-empty-x", "an input batch with no samples",
            "stax.serial(stax.Dense(3))[2](X[:0])",
            ValueError, r"^kernel_fn: x1 has no samples \(shape \(0, 3\)\)\. Fix: pass at least one sample in x1"),
        Row("stax-fanout-no-parallel", "FanOut followed by a one-input layer instead of parallel",
            "stax.serial(stax.Dense(3), stax.FanOut(2), stax.Relu())[2](X)",
            ValueError, r"^kernel_fn: Relu\(\) got 2 branches \(after FanOut\)\. Fix: put parallel"),
        Row("stax-window-too-large", "a VALID convolution window larger than the image",
            "stax.serial(stax.Conv(3, (5, 5)), stax.Relu())[2](jnp.ones((2, 3, 3, 1)))",
            ValueError, r"^kernel_fn: Conv's window \(5, 5\) is larger than its input's positions \(3, 3\)"),
        Row("stax-layernorm-axis", "a LayerNorm axis the input does not have",
            "stax.serial(stax.Dense(3), stax.LayerNorm(axis=5))[2](X)",
            ValueError, r"^stax\.LayerNorm: axis=5 is outside the input's 2 axes"),
        Row("stax-quadrature-degree", "ElementwiseNumerical with fewer than 2 quadrature nodes",
            "stax.ElementwiseNumerical(jnp.tanh, 1)",
            ValueError, r"^stax\.ElementwiseNumerical: deg must be an int >= 2, got 1\. Fix: pass deg >= 2"),
        Row("stax-not-elementwise", "ElementwiseNumerical of a function that mixes entries (here a norm)",
            "stax.ElementwiseNumerical(lambda x: x / jnp.linalg.norm(x), 25)",
            ValueError, r"^stax\.ElementwiseNumerical: fn must act elementwise, but fn\(x\) on a \(3, 4\) array differs from fn on each entry alone by up to .*Fix: write the nonlinearity elementwise.*or.*Monte Carlo kernels"),
        Row("stax-negative-std", "a negative weight standard deviation",
            "stax.Dense(3, W_std=-1.0)",
            ValueError, r"^stax\.Dense: W_std must be a real number in \[0, inf\), got -1\.0"),
        Row("stax-get", "a misspelt kernel name in get",
            "stax.serial(stax.Dense(3))[2](X, None, 'ntkk')",
            ValueError, r"^kernel_fn: get must be None, 'nngp', 'ntk' or a tuple of them, got 'ntkk'"),
        Row("stax-not-a-layer", "a plain function among the layers of serial",
            "stax.serial(stax.Dense(3), jnp.tanh)",
            TypeError, r"^stax\.serial: layer 1 must be a layer of ntk_core\.stax"),
        Row("stax-fan-in-widths", "FanInSum of branches of different widths",
            "stax.serial(stax.FanOut(2), stax.parallel(stax.Dense(3), stax.Dense(4)), stax.FanInSum())[2](X)",
            ValueError, r"^kernel_fn: FanInSum's branches have different widths \[3, 4\]"),
        Row("stax-diagonal-spatial-pool", "diagonal_spatial=True on a network with a global pool",
            "stax.serial(stax.Conv(3, (2, 2)), stax.Relu(), stax.GlobalAvgPool())[2](jnp.ones((2, 4, 4, 1)), diagonal_spatial=True)",
            ValueError, r"^kernel_fn: diagonal_spatial=True, but a layer mixes positions"),
        Row("stax-attention-sqrt-scaling", "self-attention with 1/√d logits and a softmax (no closed-form kernel)",
            "stax.GlobalSelfAttention(3, 2, 2, 1, linear_scaling=False)[2](jnp.ones((2, 4, 3)))",
            ValueError, r"^kernel_fn: linear_scaling=False \(1/√n_chan_key logits\) has no closed-form kernel for attention_mechanism='SOFTMAX', only for 'IDENTITY'\. Fix: pass linear_scaling=True"),
        Row("stax-attention-sum-channels", "summed positional embeddings with other channels than the input's",
            "stax.GlobalSelfAttention(3, 2, 2, 1, pos_emb_type='SUM', n_chan_pos_emb=5)[2](jnp.ones((2, 4, 3)))",
            ValueError, r"^stax\.GlobalSelfAttention: pos_emb_type='SUM' adds the embeddings to the input's 3 channels, but n_chan_pos_emb=5 \(in kernel_fn\)\. Fix:"),
        Row("stax-attention-decay-fn", "a positional covariance decay that is not a function",
            "stax.GlobalSelfAttention(3, 2, 2, 1, pos_emb_type='SUM', pos_emb_decay_fn=0.5)",
            TypeError, r"^stax\.GlobalSelfAttention: pos_emb_decay_fn must be None or callable, got float\. Fix:"),
        Row("stax-mask-constant-type", "a mask_constant that is not a number",
            "stax.serial(stax.Dense(3))[2](X, None, 'nngp', mask_constant='pad')",
            TypeError, r"^kernel_fn: mask_constant must be None or a real number, got str\. Fix:"),
        Row("stax-mask-concat-pool", "masked inputs pooled right after FanInConcat (as neural-tangents, refused)",
            "stax.serial(stax.FanOut(2), stax.parallel(stax.Conv(2, (2,)), stax.Conv(2, (2,))), stax.FanInConcat(), stax.GlobalAvgPool())[2](jnp.ones((2, 4, 3)).at[0, 3].set(-1.0), mask_constant=-1.0)",
            ValueError, r"^kernel_fn: with mask_constant, GlobalAvgPool after FanInConcat \(each branch's channels keep their own masks\)\. Fix: insert a Dense or Conv layer between FanInConcat and GlobalAvgPool"),
        # -- infinite-width kernels derived from a plain JAX model (issue 50) ----------
        Row("derived-unmapped", "an operation on the activations without an infinite-width rule: max-pooling (a softmax, a cumulative sum, a transpose that mixes positions and channels likewise)",
            "ntk_core.infinite_kernel_fn(lambda w, x: jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 1), (1, 1, 1), 'VALID').reshape(x.shape[0], -1) @ w, jnp.ones((2, 2)), W_std=1.0)(X.reshape(4, 3, 1))",
            ValueError, r"^ntk_core\.infinite_kernel_fn: reduce_window_max at .*: this operation on \(N, 3, 1\) with window_dimensions=\(1, 2, 1\).* has no infinite-width rule; the derivation maps x @ W .*Fix: .*Monte Carlo kernels: .*ntk_core\.monte_carlo_kernels\(init_fn"),
        Row("derived-weight-tying", "one weight used twice (weight tying)",
            "ntk_core.infinite_kernel_fn(lambda w, x: jnp.tanh(x @ w) @ w.T, W, W_std=1.0)(X)",
            ValueError, r"^ntk_core\.infinite_kernel_fn: dot_general at .*: the parameter '<params>' is used twice \(weight tying"),
        Row("derived-two-nonlinearities", "a nonlinearity of a non-Gaussian value (a ReLU branch summed with a Gaussian one, then tanh)",
            "ntk_core.infinite_kernel_fn(lambda p, x: jnp.tanh(jax.nn.relu(x @ p['w']) + x @ p['u']), {'w': W, 'u': W}, W_std=1.0)(X)",
            ValueError, r"^ntk_core\.infinite_kernel_fn: tanh at .*: a nonlinearity \(quadrature of tanh\) of a non-Gaussian input \(the output of FanInSum .*Fix: insert a Dense or Conv layer between them"),
        Row("derived-shared-branches", "a sum of two branches computed from the same weight",
            "ntk_core.infinite_kernel_fn(lambda w, x: (h := x @ w).sum(1) + jnp.tanh(h).sum(1), jnp.ones((1, 2)), W_std=1.0)(X.reshape(4, 3, 1))",
            ValueError, r"^ntk_core\.infinite_kernel_fn: add at .*: a sum of branches that share '<params>': they are not independent Gaussians"),
        Row("derived-loop", "a loop whose trip count depends on x cannot be unrolled (loops of a static length are)",
            "ntk_core.infinite_kernel_fn(lambda w, x: jax.lax.while_loop(lambda h: h.sum() < 9, lambda h: jnp.tanh(h @ w), x), jnp.ones((3, 3)), W_std=1.0)(X)",
            ValueError, r"^ntk_core\.infinite_kernel_fn: while at .*: a while loop whose trip count depends on the parameters or x \(it cannot be unrolled\) has no infinite-width rule; .*Fix: .*monte_carlo_kernels\(model, x1.*ntk_core\.monte_carlo_kernels\(init_fn, apply_fn"),
        Row("derived-batch-statistics", "samples mixed by batch statistics (BatchNorm in training mode, a batch mean)",
            "ntk_core.infinite_kernel_fn(lambda w, x: (h := x @ w) - h.mean(0), W, W_std=1.0)(X)",
            ValueError, r"^ntk_core\.infinite_kernel_fn: reduce_sum at .*: a sum over the samples' axis \(axes \(0,\) of \(N, 2\)\): batch statistics \(BatchNorm in training mode\).*Fix: use BatchNorm in eval mode \(Flax: use_running_average=True"),
        Row("derived-stop-gradient", "a weight behind stop_gradient (held fixed: its NTK term)",
            "ntk_core.infinite_kernel_fn(lambda w, x: x @ jax.lax.stop_gradient(w), W, W_std=1.0)(X)",
            ValueError, r"^ntk_core\.infinite_kernel_fn: dot_general at .*: the matrix product's weight is stop_gradient of '<params>': a weight held fixed.*Fix: drop stop_gradient"),
        Row("derived-input-rank", "x of a rank or size the model was not built for (the model's own error, with x's shape)",
            "ntk_core.infinite_kernel_fn(mlp, P, W_std=1.0)(jnp.ones((4, 5)))",
            TypeError, r"^ntk_core\.infinite_kernel_fn: the model failed when traced on x of shape \(N, 5\) \(rank 2, per sample \(5,\)\): TypeError: .*Fix: pass x1 of the shape the model was built for"),
        Row("derived-mask-pool", "mask_constant with a derived model that averages over positions (it would divide by the padded length)",
            "ntk_core.infinite_kernel_fn(lambda w, x: (x @ w).mean(1), jnp.ones((3, 2)), W_std=1.0)(jnp.ones((2, 4, 3)), None, 'nngp', mask_constant=-1.0)",
            ValueError, r"^ntk_core\.infinite_kernel_fn: mask_constant with a model that pools or flattens positions\. Fix: write the network with ntk_core\.stax"),
        Row("derived-missing-prior", "a weight leaf missing from a per-leaf W_std",
            "ntk_core.infinite_kernel_fn(mlp, P, W_std={'w': 1.0})(X)",
            ValueError, r"^ntk_core\.infinite_kernel_fn: the weight 'v' \(used at .*\) has no prior\. Fix: pass W_std=\{'v': std\}"),
        Row("derived-unknown-path", "a per-leaf prior naming no parameter leaf (a typo)",
            "ntk_core.infinite_kernel_fn(mlp, P, W_std={'w': 1.0, 'vv': 1.0})",
            ValueError, r"^ntk_core\.infinite_kernel_fn: W_std names the parameter 'vv', which is not a leaf of params\. Fix: .*nearest: 'v'"),
        Row("derived-bias-no-prior", "a bias without b_std",
            "ntk_core.infinite_kernel_fn(lambda p, x: x @ p['w'] + p['b'], {'w': W, 'b': jnp.zeros(2)}, W_std=1.0)(X)",
            ValueError, r"^ntk_core\.infinite_kernel_fn: the bias 'b' \(used at .*\) has no prior\. Fix: pass b_std=\{'b': std\}"),
    ]  # fmt: skip


@functools.cache
def _namespace(needs: tuple) -> dict:
    namespace: dict = {}
    exec(SETUP, namespace)
    for name in needs:
        exec({"flax": FLAX_SETUP, "haiku": HAIKU_SETUP, "equinox": EQUINOX_SETUP}[name], namespace)
    return namespace


def _missing(needs) -> list[str]:
    return [m for m in needs if not frameworks.installed(m)]


ROWS = _rows()


def test_table_has_at_least_25_rows_with_unique_ids():
    assert len(ROWS) >= 25
    assert len({r.id for r in ROWS}) == len(ROWS)


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input(row):
    missing = _missing(row.needs)
    if missing:
        pytest.skip(f"needs {missing}")
    namespace = _namespace(tuple(row.needs))
    if issubclass(row.raises, Warning):
        from ntk_core._jax import environment as _environment

        _environment._WARNED.clear()  # warnings fire once per process per cause
        with pytest.warns(row.raises, match=row.match) as record:
            eval(row.call, namespace)
        assert any("Fix:" in str(w.message) for w in record if issubclass(w.category, row.raises))
        return
    with pytest.raises(row.raises, match=row.match) as info:
        eval(row.call, namespace)
    # exactly these types, or the library's own NonFiniteError (a ValueError)
    assert type(info.value) in (TypeError, ValueError, NonFiniteError)
    assert "Fix:" in str(info.value)


def test_bfloat16_and_bool_inputs_are_numbers():
    """Not bad input: bfloat16 (an ml_dtypes type) and bool arrays are accepted."""
    import jax.numpy as jnp
    import numpy as np

    import ntk_core

    w, x = jnp.ones((3, 2)), jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    f = lambda w, x: jnp.tanh(x.astype(jnp.float32) @ w)  # noqa: E731
    expected = ntk_core.empirical_ntk(f, w, x.astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_allclose(ntk_core.empirical_ntk(f, w, x.astype(jnp.bfloat16)), expected)
    assert ntk_core.empirical_ntk(f, w, x > 0).shape == (4, 4)


# -- the documentation table ------------------------------------------------------------

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "errors.md"
START, END = "<!-- table:start -->", "<!-- table:end -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table() -> str:
    lines = [
        "| # | id | mistake | call | raises | message (regex) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for i, r in enumerate(ROWS, 1):
        lines.append(
            f"| {i} | `{r.id}` | {_cell(r.mistake)} | `{_cell(r.call)}` | "
            f"`{r.raises.__name__}` | `{_cell(r.match)}` |"
        )
    return "\n".join(lines)


def _render(text: str) -> str:
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{markdown_table()}\n{END}{tail}"


def test_docs_table_is_current():
    text = DOCS.read_text()
    assert _render(text) == text, (
        "docs/errors.md is out of date: run python tests/core/test_bad_input.py"
    )


def test_docs_setup_is_current():
    text = DOCS.read_text()
    for block in (SETUP, FLAX_SETUP, HAIKU_SETUP, EQUINOX_SETUP):
        assert block in text


if __name__ == "__main__":  # rewrite the docs table from ROWS
    DOCS.write_text(_render(DOCS.read_text()))
    print(f"wrote {DOCS} ({len(ROWS)} rows)", file=sys.stderr)
