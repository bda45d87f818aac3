"""``ntk_core.infinite_kernel_fn``: the infinite-width NNGP / NTK of a plain JAX model,
derived from its jaxpr (:mod:`.graph`), its priors (:mod:`.priors`) and stax's kernel
rules (:mod:`.rules`), with stax's ``kernel_fn`` contract (:class:`KernelFn`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ntk_core._derived import graph as _graph
from ntk_core._derived import paths as _paths
from ntk_core._derived import priors as _priors
from ntk_core._derived import report as _report
from ntk_core._derived.graph import Kind
from ntk_core._derived.paths import leaf_path_names, naming
from ntk_core._derived.rules import build_rule
from ntk_core._errors import bad, check_int
from ntk_core._infinite.kernel_fn import KernelFn, _inputs

FN = _paths.FN


class DerivedKernelFn:
    """``kernel_fn(x1, x2=None, get=None, **options)`` of :func:`infinite_kernel_fn`: the
    stax kernel function of the network derived from the model, one per input signature
    (derived at its first call, then cached); ``report(x)`` describes that network."""

    def __init__(self, apply_fn, params, w_std, b_std, deg):
        self.apply_fn = apply_fn
        self.params = params
        self.names = leaf_path_names(params)
        self._w, self._b, self.deg = w_std, b_std, deg
        self._built: dict = {}  # (per-sample shape, dtype) -> (graph, priors, KernelFn)
        self.caller = FN  # the public function messages name (an adapter's sets its own)

    def __repr__(self) -> str:
        return f"<ntk_core.infinite_kernel_fn of {getattr(self.apply_fn, '__name__', 'apply_fn')}>"

    def _build(self, x1):
        with naming(self.caller):
            return self._derived(x1)

    def _derived(self, x1):
        if hasattr(x1, "shape") and hasattr(x1, "dtype"):  # a warm call: no second input
            key = (tuple(x1.shape[1:]), jnp.dtype(x1.dtype))  # pass (the KernelFn checks x1)
            if key in self._built:
                return self._built[key]
        x = _inputs(x1, "x1")
        key = (tuple(x.shape[1:]), jnp.dtype(x.dtype))
        if key not in self._built:
            struct = jax.ShapeDtypeStruct((2, *key[0]), key[1])
            g = _graph.derive(self.apply_fn, self.params, struct, self.names)
            priors = _priors.resolve(g.roles, g.names, self._w, self._b, g.parents)
            leaves = jax.tree_util.tree_leaves(self.params)
            _priors.check_values(g.roles, g.names, leaves, priors, g.parents)
            name = f"derived({getattr(self.apply_fn, '__name__', 'apply_fn')}, {key[0]})"
            if len(self._built) >= 16:
                self._built.clear()
            self._built[key] = (g, priors, KernelFn(build_rule(g, priors, self.deg, name)))
        return self._built[key]

    def __call__(self, x1, x2=None, get=None, **options):
        g, _, kernel_fn = self._build(x1)
        pools = (Kind.SumPool, Kind.GlobalSumPool, Kind.Flatten)
        if options.get("mask_constant") is not None and any(n.kind in pools for n in g.nodes):
            # a model's mean over positions is a sum times 1/size: with masked positions it
            # would still divide by the full size (silently wrong); stax's pools know masks
            what = "mask_constant with a model that pools or flattens positions"
            fix = "write the network with ntk_core.stax (its pools average unmasked positions)"
            raise bad(ValueError, self.caller, what, fix)
        if g.input_perm is not None:  # read channels-first by the model: stax's layout
            x1, x2 = _transposed(x1, g.input_perm), _transposed(x2, g.input_perm)
        return kernel_fn(x1, x2, get, **options)

    def report(self, x) -> str:
        """The derived layer graph for inputs like ``x`` (N, ..., C): each layer, its rule
        (closed form or quadrature), its prior, its source line, what was looked through."""
        g, priors, _ = self._build(x)
        return _report.describe(g, priors, self.deg)


def _transposed(x, perm):
    """``x`` (N, C, H, W as the model reads it) channels-last; None stays None."""
    if x is None:
        return None
    if isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return jnp.transpose(x, perm)
    return np.transpose(np.asarray(x), perm)


def infinite_kernel_fn(apply_fn, params, *, W_std=None, b_std=None, deg=25):
    """The infinite-width NNGP and NTK of the plain JAX model ``apply_fn(params, x)``,
    derived from its program: the limit, as every hidden width grows, of its expected
    NNGP and NTK at initialisation, in the model's own parameterisation.

    The model is traced (``jax.make_jaxpr``) per input signature at the first kernel call
    and its jaxpr mapped onto ``ntk_core.stax``'s rules: a matrix product or convolution
    whose other operand is one parameter leaf (possibly transposed, reshaped, cast or
    scaled by a constant c) is a Dense or Conv layer with the real widths (standard
    parameterisation; c = 1/√fan_in with W ~ N(0, 1) is the NTK parameterisation), a
    parameter added after it a bias, a chain of elementwise operations on one
    pre-activation one nonlinearity (stax's closed form where the chain is one: ReLU,
    leaky ReLU, |x|, erf, exact GELU, sin, cos, exp, sign; else ``deg``-point
    quadrature of the chain: tanh, sigmoid, SiLU, tanh-GELU), sums over all positions and
    window sums global and window pools, a reshape (N, *S, C) -> (N, S·C) Flatten, sums of
    independent branches FanInSum, channel concatenations FanInConcat, channel means and
    variances normalising the activations LayerNorm (a parameter multiplying per channel
    a gain), constant scalings scalings. ``pjit``, ``custom_jvp`` / ``custom_vjp`` (their
    primal), remat, casts and broadcasts are looked through. See ``docs/infinite-width.md``
    ("Kernels of your own model").

    Args:
      apply_fn: ``apply_fn(params, x) -> (N, ..., O)``, x ``(N, *S, C)`` (samples
        independent), or ``(N, C, *S)`` where its first layer reads it channels first
        (an NCHW convolution): then x1 and x2 are transposed to channels last.
      params: the model's parameters (a pytree); their values only test the priors.
      W_std: the weights' prior: one float for every weight leaf, or a Mapping from a
        leaf's path name (``ntk_core.adapters.leaf_path_names(params)``) to a float; a
        weight leaf used with fan-in n has entries of variance W_std²/n (Flax's
        ``lecun_normal``: 1; Haiku's truncated normal: √0.7737; ``W / √n`` with W ~ N(0,
        1): √n); a gain leaf (LayerNorm's scale) entries of mean square W_std².
      b_std: the biases' prior, the same way: entries of variance b_std² (0 for a
        zero-initialised bias, which still adds to the NTK).
      deg: Gauss–Hermite degree of the quadrature of nonlinearities without a closed form.

    Returns: a kernel function with stax's contract: ``kernel_fn(x1, x2=None, get=None,
    **options)`` → NNGP / NTK ``(N1, N2)`` (``(N1, N2, H, H', ...)`` where the output keeps
    positions), ``get`` ``"nngp"``, ``"ntk"``, a tuple or None, the blocked engine's
    ``batch_size``, ``out=``, ``devices``; and ``kernel_fn.report(x)``, the derived graph.

    Raises: ValueError naming the primitive and its source line, with the alternative
    (``ntk_core.monte_carlo_kernels``), for what has no infinite-width rule: max-pooling,
    softmax, weight tying, a nonlinearity of a non-Gaussian input (two stacked
    nonlinearities), branches sharing a weight, loops whose trip count is not static
    (static ones are unrolled, a stacked leaf's slice per step its own weight), batch
    statistics, stop_gradient of a weight, unknown primitives touching x; x of a shape
    the model cannot take; a
    weight or bias leaf without a prior, or a prior naming no leaf (at construction).
    UserWarning for a weight leaf whose values contradict its prior.

    Cost: one trace of the model per input signature; then stax's: per pair of inputs
    O(L·P) for L layers and P tracked pairs of positions, one compiled program per input
    shape and ``get``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, ntk_core
      >>> def mlp(p, x):
      ...     return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"]
      >>> k1, k2 = jax.random.split(jax.random.PRNGKey(0))
      >>> params = {"w1": jax.random.normal(k1, (3, 256)) / jnp.sqrt(3.0),
      ...           "b1": jnp.zeros(256), "w2": jax.random.normal(k2, (256, 1)) / 16.0}
      >>> kernel_fn = ntk_core.infinite_kernel_fn(mlp, params, W_std=1.0, b_std=0.0)
      >>> x = np.random.RandomState(0).randn(4, 3).astype(np.float32)
      >>> kernel_fn(x, None, "ntk").shape
      (4, 4)

    References: Yang, "Tensor Programs I/II" (arXiv 1910.12478, 2006.14548): such limits
    exist for any architecture of these operations; Novak et al., "Neural Tangents", ICLR
    2020 (the rules); Sohl-Dickstein et al. 2020, arXiv 2001.07301 (standard
    parameterisation).
    """
    if not callable(apply_fn):
        what = f"apply_fn must be callable, got {type(apply_fn).__name__}"
        raise bad(TypeError, FN, what, "pass apply_fn(params, x)")
    names = leaf_path_names(params)
    w = _priors.check_argument("W_std", W_std, names)
    b = _priors.check_argument("b_std", b_std, names)
    deg = check_int(FN, "deg", deg, "pass deg >= 2, e.g. deg=25", low=2)
    return DerivedKernelFn(apply_fn, params, w, b, deg)
