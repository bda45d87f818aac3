"""The layers of ``ntk_core.stax``: arguments checked, the finite network (init_fn,
apply_fn) and the kernel rule (:mod:`.affine`, :mod:`.closed_forms`, :mod:`.spatial`)."""

from __future__ import annotations

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ntk_core._errors import bad, check_int, check_real
from ntk_core._infinite import affine, closed_forms, masking, spatial, windows
from ntk_core._infinite.layer import Layer, Rule, make_layer, stateless
from ntk_core._infinite.state import Kern, pair_variances, refuse_channel_masks, remask

PARAMETERIZATIONS = ("ntk", "standard")


def _std(fn, name, value, optional=False):
    if optional and value is None:
        return None
    return check_real(fn, name, value, f"pass a finite {name} >= 0, e.g. {name}=1.0")


def _choice(fn, name, value, allowed):
    if value not in allowed:
        what = f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}"
        raise bad(ValueError, fn, what, f"pass {name}={allowed[0]!r}")
    return value


def _axes_default(fn, batch_axis, channel_axis):
    if batch_axis != 0 or channel_axis not in (-1,):
        what = f"batch_axis must be 0 and channel_axis -1, got {batch_axis!r} and {channel_axis!r}"
        fix = "move the axes first, e.g. x = jnp.moveaxis(x, channel_axis, -1)"
        raise bad(ValueError, fn, what, fix)


def _ints(fn, name, value, n=None):
    values = tuple(value) if isinstance(value, (tuple, list)) else None
    if (
        not values
        or (n is not None and len(values) != n)
        or not all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1 for v in values
        )
    ):
        size = "a tuple of positive ints" + ("" if n is None else f" of length {n}")
        what = f"{name} must be {size}, got {value!r}"
        fix = f"pass e.g. {name}=(3, 3)"
        raise bad(ValueError, fn, what, fix)
    return tuple(int(v) for v in values)


def _check_gaussian(k: Kern, name: str):
    if not k.gaussian:
        what = f"{name}'s input must be Gaussian (an affine layer's output), not {k.source}'s"
        fix = f"insert a Dense or Conv layer between {k.source} and {name}"
        raise bad(ValueError, "kernel_fn", what, fix)


def _check_windows(k: Kern, name: str, window, strides, padding):
    """ValueError where a VALID window is larger than the input (no output position)."""
    for size, w, s in zip(k.spatial, window, strides, strict=True):
        if windows.out_size(size, w, s, padding) < 1:
            what = (
                f"{name}'s window {tuple(window)} is larger than its input's positions {k.spatial}"
            )
            fix = "use padding='SAME', a smaller window or larger inputs"
            raise bad(ValueError, "kernel_fn", what, fix)


def _check_spatial(k: Kern, name: str, rank: int):
    if len(k.spatial) != rank:
        what = (
            f"{name} acts on {rank} spatial axes, but its input has {len(k.spatial)} ({k.spatial})"
        )
        fix = f"give the inputs shape (N, {'S, ' * rank}C), or fix the layer's window"
        raise bad(ValueError, "kernel_fn", what, fix)


# ----- affine layers -----


def _affine_args(fn, W_std, b_std, parameterization, s, **fields):
    """The checked arguments of a Dense or Conv layer."""
    return types.SimpleNamespace(
        W_std=_std(fn, "W_std", W_std),
        b_std=_std(fn, "b_std", b_std, optional=True),
        parameterization=_choice(fn, "parameterization", parameterization, PARAMETERIZATIONS),
        s=_ints(fn, "s", s, 2),
        **fields,
    )


def _affine_network(args, window: tuple, out: int, product):
    """(init_fn, apply_fn) of z = c·product(x, W) + b over a window of ``window`` positions
    (() for Dense): NTK parameterisation W, b ~ N(0, 1), c = σw/√fan_in, b scaled by σb;
    standard W ~ N(0, σw²·s₀/fan_in), b ~ N(0, σb²), c = 1/√s₀ (neural-tangents')."""
    width = out * args.s[1]

    def init_fn(key, input_shape):
        k1, k2 = jax.random.split(key)
        n_in = input_shape[-1]
        w = jax.random.normal(k1, window + (n_in, width))
        b = None if args.b_std is None else jax.random.normal(k2, (width,))
        if args.parameterization == "standard":
            w = w * args.W_std / math.sqrt(n_in / args.s[0] * math.prod(window))
            b = None if b is None else b * args.b_std
        shape = jax.eval_shape(lambda x: product(x, w), jax.ShapeDtypeStruct(input_shape, w.dtype))
        return tuple(shape.shape), (w, b)

    def apply_fn(params, x, **kwargs):
        w, b = params
        y = product(x, w)
        if args.parameterization == "ntk":
            y = y * (args.W_std / math.sqrt(x.shape[-1] * math.prod(window)))
            return y if b is None else y + args.b_std * b
        y = y / math.sqrt(args.s[0])
        return y if b is None else y + b

    return init_fn, apply_fn


def Dense(
    out_dim, W_std=1.0, b_std=None, batch_axis=0, channel_axis=-1, parameterization="ntk", s=(1, 1)
) -> Layer:
    """Fully connected layer over the channel (last) axis (neural-tangents' arguments).

    Kernel: Σ' = σw²·Σ + σb²; NTK parameterisation Θ' = Σ' + σw²·Θ, standard Θ' =
    (C_in/s₀)·Σ + σw²·Θ (+ 1 with a bias: ``b_std=None`` is no bias, 0.0 a zero one).
    Finite layer: ``out_dim`` outputs (times s₁), W ~ N(0, 1) scaled by σw/√C_in (NTK) or
    ~ N(0, σw²·s₀/C_in) (standard). Raises ValueError/TypeError for a non-positive
    ``out_dim``, negative or non-finite stds, another ``parameterization``, other axes.

    Example:
      >>> import numpy as np
      >>> from ntk_core import stax
      >>> *_, kernel_fn = stax.Dense(4, W_std=2.0, b_std=0.5)
      >>> x = np.eye(2, 3, dtype=np.float32)                         # (N, C) = (2, 3)
      >>> k = np.asarray(kernel_fn(x, None, "nngp"), np.float64)
      >>> bool(np.allclose(k, 4 * x @ x.T / 3 + 0.25))               # σw²·⟨x1, x2⟩/C + σb²
      True
    """
    fn = "stax.Dense"
    out_dim = check_int(fn, "out_dim", out_dim, "pass e.g. Dense(512)")
    _axes_default(fn, batch_axis, channel_axis)
    args = _affine_args(fn, W_std, b_std, parameterization, s, out_dim=out_dim)

    def product(x, w):
        return jnp.tensordot(x, w, (-1, 0), precision="highest")

    init_fn, apply_fn = _affine_network(args, (), out_dim, product)
    name = f"Dense({out_dim}, W_std={args.W_std:g}, b_std={args.b_std}, {args.parameterization})"
    key = ("Dense", out_dim, args.W_std, args.b_std, args.parameterization, tuple(args.s))
    rule = Rule(name, lambda k: remask(_one_mask(affine.dense(k, args))), key=key)
    return make_layer(rule, init_fn, apply_fn, masking.channels_all)


def _conv_specs(rank):
    letters = "HWDXYZ"[:rank] if rank <= 6 else None
    if letters is None:
        what = f"at most 6 spatial axes, got {rank}"
        fix = "flatten extra axes into channels"
        raise bad(ValueError, "stax.Conv", what, fix)
    return ("N" + letters + "C", letters + "IO", "N" + letters + "C")


def _circular_pad(x, window, strides):
    widths = [(0, 0)]
    for size, w, s in zip(x.shape[1:-1], window, strides, strict=True):
        widths.append(windows.pads(size, w, s, "SAME"))
    return jnp.pad(x, widths + [(0, 0)], mode="wrap")


def Conv(
    out_chan,
    filter_shape,
    strides=None,
    padding="VALID",
    W_std=1.0,
    b_std=None,
    dimension_numbers=None,
    parameterization="ntk",
    s=(1, 1),
) -> Layer:
    """Convolution over the spatial axes of (N, *S, C) inputs (neural-tangents' arguments;
    ``dimension_numbers`` None or channels last, e.g. ``("NHWC", "HWIO", "NHWC")``).

    Kernel: Σ'(h, h') = σw²/|k|·Σ_δ Σ(s·h + δ, s·h' + δ) + σb² over the filter's offsets δ
    (zero outside the image for SAME and VALID, wrapped for CIRCULAR); the NTK as
    :func:`Dense`'s with the same window sum (fan-in C_in·|k| in the standard one). Cost
    per pair: |k| strided passes per spatial axis over the tracked pairs of positions.
    Raises ValueError for a filter rank other than the inputs' spatial rank, a VALID
    window larger than the image, other paddings or dimension numbers.

    Example:
      >>> import numpy as np
      >>> from ntk_core import stax
      >>> *_, kernel_fn = stax.serial(stax.Conv(8, (3, 3), padding="SAME"), stax.Relu(),
      ...                             stax.GlobalAvgPool(), stax.Dense(1))
      >>> x = np.random.RandomState(0).randn(2, 5, 5, 3).astype(np.float32)  # (N, H, W, C)
      >>> kernel_fn(x, None, "ntk").shape
      (2, 2)
    """
    fn = "stax.Conv"
    out_chan = check_int(fn, "out_chan", out_chan, "pass e.g. Conv(64, (3, 3))")
    filter_shape = _ints(fn, "filter_shape", filter_shape)
    rank = len(filter_shape)
    strides = (1,) * rank if strides is None else _ints(fn, "strides", strides, rank)
    specs = _conv_specs(rank)
    if dimension_numbers is not None and tuple(dimension_numbers) != specs:
        what = f"dimension_numbers must be None or {specs}, got {dimension_numbers!r}"
        fix = "transpose the inputs to channels last and pass dimension_numbers=None"
        raise bad(ValueError, fn, what, fix)
    args = _affine_args(
        fn,
        W_std,
        b_std,
        parameterization,
        s,
        out_chan=out_chan,
        filter_shape=filter_shape,
        strides=strides,
        padding=_choice(fn, "padding", padding, windows.PADDINGS),
    )

    def product(x, w):
        pad = args.padding
        if pad == "CIRCULAR":
            x, pad = _circular_pad(x, filter_shape, strides), "VALID"
        dn = lax.conv_dimension_numbers(x.shape, w.shape, specs)
        return lax.conv_general_dilated(
            x, w, strides, pad, dimension_numbers=dn, precision="highest"
        )

    init_fn, apply_fn = _affine_network(args, filter_shape, out_chan, product)

    def transform(k):
        _check_spatial(k, "Conv", rank)
        _check_windows(k, "Conv", filter_shape, strides, args.padding)
        return _strided_masks(affine.conv(k, args), filter_shape, strides, args.padding)

    name = f"Conv({out_chan}, {filter_shape}, {strides}, {args.padding}, W_std={args.W_std:g}, "
    name += f"b_std={args.b_std}, {args.parameterization})"

    def mask_fn(mask, x):
        return _centres(masking.channels_all(mask, x), filter_shape, strides, args.padding)

    key = ("Conv", out_chan, filter_shape, strides, args.padding, args.W_std, args.b_std)
    key += (args.parameterization, tuple(args.s))
    return make_layer(Rule(name, transform, key=key), init_fn, apply_fn, mask_fn)


# ----- nonlinearities -----


def _activation(name: str, fn, forms, key=None) -> Layer:
    """A nonlinearity φ = ``fn`` with closed form ``forms(q11, q12, q22) -> (Σ', Σ̇)``;
    ``key``: its exact arguments (:class:`~.layer.Rule`'s ``key``)."""

    def transform(k: Kern):
        _check_gaussian(k, name)
        q11, q22, self1, self2 = pair_variances(k)
        q12 = k.nngp
        if k.same_samples():  # a Gram matrix (or a tile of one, k.offset): each sample
            # with itself is its own covariance bit for bit, so ρ = 1 there (see
            # closed_forms). Positions on their diagonal (or none), a select: it fuses into
            # the closed form's reads (the scatter wrote N² copies: peak 800 -> 740 MiB for
            # the 3-layer FC at N = 4 000, 3.13 -> 2.87 GB for the 21-layer Flatten CNN at
            # N = 256); all pairs of positions, the scatter (there the select made the 8x8
            # WideResNet 2.5 -> 3.5 s warm)
            n1, n2 = q12.shape[:2]
            shift = 0 if k.offset is None else k.offset
            if k.diagonal or q12.ndim == 2:
                same = lax.broadcasted_iota(jnp.int32, (n1, n2), 0) + shift == (
                    lax.broadcasted_iota(jnp.int32, (n1, n2), 1)
                )
                same = same.reshape(same.shape + (1,) * (q12.ndim - 2))
                q12 = jnp.where(same, k.cov1[:, None], q12)
            elif k.offset is None:
                q12 = q12.at[jnp.arange(n1), jnp.arange(n1)].set(k.cov1)
            else:  # a tile: its row i is column i + offset, where that is in the tile
                rows = jnp.arange(n1)
                cols = rows + shift
                cols = jnp.where((cols >= 0) & (cols < n2), cols, n2)  # n2: dropped
                q12 = q12.at[rows, cols].set(k.cov1, mode="drop")
        nngp, dot = forms(q11, q12, q22)
        out = k.replace(
            nngp=nngp,
            ntk=None if k.ntk is None else dot * k.ntk,
            cov1=forms(self1[0], k.cov1, self1[1])[0],
            cov2=None if k.cov2 is None else forms(self2[0], k.cov2, self2[1])[0],
            gaussian=False,
            is_input=False,
        )
        return remask(out)  # φ(0) may be nonzero: masked positions stay 0

    return make_layer(Rule(name, transform, key=key), *stateless(fn))


def _real(fn, name, value):
    return check_real(fn, name, value, f"pass a finite number, e.g. {name}=1.0", low=-math.inf)


def ABRelu(a, b, do_stabilize=False) -> Layer:
    """φ(x) = a·min(x, 0) + b·max(x, 0)."""
    a, b = _real("stax.ABRelu", "a", a), _real("stax.ABRelu", "b", b)
    return _activation(
        f"ABRelu({a:g}, {b:g})",
        lambda x: a * jnp.minimum(x, 0) + b * jnp.maximum(x, 0),
        closed_forms.ab_relu(a, b),
        key=("ABRelu", a, b),
    )


def Relu(do_stabilize=False) -> Layer:
    """φ(x) = max(x, 0)."""
    return _activation("Relu()", jax.nn.relu, closed_forms.ab_relu(0.0, 1.0), key=("Relu",))


def LeakyRelu(alpha, do_stabilize=False) -> Layer:
    """φ(x) = x for x >= 0, α·x below."""
    alpha = _real("stax.LeakyRelu", "alpha", alpha)
    return _activation(
        f"LeakyRelu({alpha:g})",
        lambda x: jnp.where(x >= 0, x, alpha * x),
        closed_forms.ab_relu(alpha, 1.0),
        key=("LeakyRelu", alpha),
    )


def Abs(do_stabilize=False) -> Layer:
    """φ(x) = |x|."""
    return _activation("Abs()", jnp.abs, closed_forms.ab_relu(-1.0, 1.0), key=("Abs",))


def Erf(a=1.0, b=1.0, c=0.0) -> Layer:
    """φ(x) = a·erf(b·x) + c."""
    a, b, c = (_real("stax.Erf", n, v) for n, v in (("a", a), ("b", b), ("c", c)))
    return _activation(
        f"Erf({a:g}, {b:g}, {c:g})",
        lambda x: a * jax.scipy.special.erf(b * x) + c,
        closed_forms.erf(a, b, c),
        key=("Erf", a, b, c),
    )


#: Sigmoid_like's scale: erf(x / SIGMOID_SCALE) / 2 + 1/2 is close to the logistic sigmoid.
SIGMOID_SCALE = 2.4020563531719796


def Sigmoid_like() -> Layer:
    """φ(x) = erf(x / 2.4020563531719796) / 2 + 1/2, close to the logistic sigmoid."""
    forms = closed_forms.erf(0.5, 1 / SIGMOID_SCALE, 0.5)
    return _activation(
        "Sigmoid_like()",
        lambda x: 0.5 * jax.scipy.special.erf(x / SIGMOID_SCALE) + 0.5,
        forms,
        key=("Sigmoid_like",),
    )


def Gelu(approximate=False) -> Layer:
    """φ(x) = x·Φ(x); the kernel is exact GELU's (``approximate`` only changes apply_fn)."""
    return _activation(
        "Gelu()",
        lambda x: jax.nn.gelu(x, approximate=bool(approximate)),
        closed_forms.gelu,
        key=("Gelu", approximate),
    )


def Sin(a=1.0, b=1.0, c=0.0) -> Layer:
    """φ(x) = a·sin(b·x + c)."""
    a, b, c = (_real("stax.Sin", n, v) for n, v in (("a", a), ("b", b), ("c", c)))
    return _activation(
        f"Sin({a:g}, {b:g}, {c:g})",
        lambda x: a * jnp.sin(b * x + c),
        closed_forms.sin(a, b, c),
        key=("Sin", a, b, c),
    )


def Cos(a=1.0, b=1.0, c=0.0) -> Layer:
    """φ(x) = a·cos(b·x + c) = a·sin(b·x + c + π/2)."""
    a, b, c = (_real("stax.Cos", n, v) for n, v in (("a", a), ("b", b), ("c", c)))
    forms = closed_forms.sin(a, b, c + math.pi / 2)
    return _activation(
        f"Cos({a:g}, {b:g}, {c:g})", lambda x: a * jnp.cos(b * x + c), forms, key=("Cos", a, b, c)
    )


def Rbf(gamma=1.0) -> Layer:
    """φ(x) = √2·sin(√(2γ)·x + π/4): the NNGP is exp(−γ·E[(u − v)²])."""
    gamma = check_real("stax.Rbf", "gamma", gamma, "pass gamma > 0, e.g. gamma=1.0", open_low=True)
    b = math.sqrt(2 * gamma)
    forms = closed_forms.sin(math.sqrt(2), b, math.pi / 4)
    return _activation(
        f"Rbf({gamma:g})",
        lambda x: math.sqrt(2) * jnp.sin(b * x + math.pi / 4),
        forms,
        key=("Rbf", gamma),
    )


def Sign() -> Layer:
    """φ(x) = sign(x); its NTK contribution is 0 (φ' = 0 almost everywhere)."""
    return _activation("Sign()", jnp.sign, closed_forms.sign, key=("Sign",))


def Exp(a=1.0, b=1.0) -> Layer:
    """φ(x) = a·exp(b·x)."""
    a, b = _real("stax.Exp", "a", a), _real("stax.Exp", "b", b)
    return _activation(
        f"Exp({a:g}, {b:g})",
        lambda x: a * jnp.exp(b * x),
        closed_forms.exp(a, b),
        key=("Exp", a, b),
    )


#: The fixed probe on which a user's φ must act entry by entry (see _check_elementwise).
_PROBE = np.random.RandomState(0).randn(3, 4).astype(np.float32) * 2


def _check_elementwise(layer: str, arg: str, fn) -> None:
    """ValueError unless ``fn`` acts entry by entry: the quadrature and closed forms assume
    φ(x)_i = φ(x_i); a φ that mixes entries (a norm, a softmax, a mean) would otherwise give
    a kernel of some other network without a word. Compares ``fn`` on a fixed (3, 4) array
    with ``fn`` on each of its entries alone (vmapped over scalars); a fn that fails on a
    scalar cannot be elementwise either. One eager call of each on 12 numbers."""
    fix = (
        "write the nonlinearity elementwise (each output entry a function of the same input "
        "entry only, e.g. jnp.where(x > 0, x, 0.1 * x)), or, for a layer that mixes entries, "
        "compute Monte Carlo kernels of the finite network (ntk_core.monte_carlo_kernels)"
    )
    x = jnp.asarray(_PROBE)
    try:
        whole = jnp.asarray(fn(x))
        alone = jnp.vectorize(fn)(x)
    except Exception as error:  # noqa: BLE001 - any failure on a scalar: not elementwise
        what = f"{arg} must act elementwise, but {arg} of a single number failed ({error!r:.200})"
        raise bad(ValueError, layer, what, fix) from error
    if whole.shape != x.shape:
        what = f"{arg} must act elementwise, but it maps shape {x.shape} to {whole.shape}"
        raise bad(ValueError, layer, what, fix)
    whole, alone = np.asarray(whole, np.float64), np.asarray(alone, np.float64)
    # Float32 ulps apart at most when elementwise (XLA may fuse the two calls differently).
    # NaN or inf at the same entries agree (e.g. jnp.log on the probe's negative entries).
    with np.errstate(invalid="ignore"):
        gap = np.where(whole == alone, 0.0, np.abs(whole - alone))
    same = (gap <= 1e-5 + 1e-4 * np.abs(alone)) | (np.isnan(whole) & np.isnan(alone))
    if not np.all(same):
        what = (
            f"{arg} must act elementwise, but {arg}(x) on a {x.shape} array differs from {arg} "
            f"on each entry alone by up to {np.nanmax(gap):.3g} (it mixes entries, e.g. a norm, "
            "a mean or a softmax)"
        )
        raise bad(ValueError, layer, what, fix)


def ElementwiseNumerical(fn, deg, df=None) -> Layer:
    """Any elementwise φ = ``fn`` by Gauss–Hermite quadrature of degree ``deg`` (deg²
    nodes), φ' by autodiff (or ``df``). Raises TypeError for a ``fn`` that is not callable,
    ValueError for ``deg`` < 2 or a ``fn`` (or ``df``) that is not elementwise (checked once
    here on a (3, 4) array against its entries one by one)."""
    name = "stax.ElementwiseNumerical"
    if not callable(fn):
        what = f"fn must be callable, got {type(fn).__name__}"
        fix = "pass e.g. fn=jnp.tanh"
        raise bad(TypeError, name, what, fix)
    deg = check_int(name, "deg", deg, "pass deg >= 2, e.g. deg=25", low=2)
    _check_elementwise(name, "fn", fn)
    if df is not None:
        _check_elementwise(name, "df", df)
    forms = closed_forms.quadrature(fn, deg, df)
    return _activation(f"ElementwiseNumerical({getattr(fn, '__name__', 'fn')}, {deg})", fn, forms)


def Elementwise(fn=None, nngp_fn=None, d_nngp_fn=None) -> Layer:
    """φ = ``fn`` with its NNGP ``nngp_fn(cov12, var1, var2)`` given in closed form, and
    ``d_nngp_fn`` (∂/∂cov12, by autodiff of nngp_fn if None). Raises TypeError for
    arguments that are not callable, ValueError for a ``fn`` that is not elementwise."""
    name = "stax.Elementwise"
    if not callable(nngp_fn):
        what = f"nngp_fn must be callable, got {type(nngp_fn).__name__}"
        fix = "pass nngp_fn(cov12, var1, var2), or use ElementwiseNumerical(fn, deg)"
        raise bad(TypeError, name, what, fix)
    if fn is not None and not callable(fn):
        what = f"fn must be callable or None, got {type(fn).__name__}"
        fix = "pass the elementwise function"
        raise bad(TypeError, name, what, fix)
    if fn is not None:
        _check_elementwise(name, "fn", fn)
    apply = fn if fn is not None else _no_finite(name)
    return _activation(
        f"Elementwise({getattr(nngp_fn, '__name__', 'nngp_fn')})",
        apply,
        closed_forms.by_autodiff(nngp_fn, d_nngp_fn),
    )


def _no_finite(name):
    def apply(x):
        what = "this layer has no finite function (fn=None)"
        fix = "pass fn= to use apply_fn"
        raise bad(ValueError, name, what, fix)

    return apply


# ----- positions -----


def _all_positions(m):
    return jnp.all(m, axis=tuple(range(1, m.ndim)))


def _centres(m, window, strides, padding):
    """Masks ``(N, *S[, C])`` of a window's output positions: each takes its window's
    centre's (neural-tangents' rule; the identity for stride 1 SAME)."""
    index = [slice(None)]
    for size, w, s in zip(m.shape[1 : 1 + len(window)], window, strides, strict=True):
        lo = windows.pads(size, w, s, "SAME")[0] if padding != "VALID" else 0
        start = (w - 1) // 2 - lo
        n = windows.out_size(size, w, s, padding)
        index.append(slice(start, start + 1 + (n - 1) * s, s))
    return m[tuple(index)]


def _one_mask(k: Kern) -> Kern:
    """After a layer masked where all its input channels are (Dense, Conv): one mask for
    every channel again (the positions masked in every branch of a FanInConcat)."""
    if k.masks is None or not k.masks.per_channel:
        return k
    return k.replace(masks=k.masks.map(lambda m: m))


def _strided_masks(k: Kern, window, strides, padding) -> Kern:
    """A convolution's or pool's output masks (:func:`_centres`), then every covariance of
    a masked position set to 0."""
    if k.masks is None:
        return k
    return remask(k.replace(masks=k.masks.map(lambda m: _centres(m, window, strides, padding))))


def _masked_global_pool(k: Kern, average: bool) -> Kern:
    """GlobalAvgPool over the unmasked positions only (their mean, as neural-tangents'
    apply_fn and kernel_fn), GlobalSumPool over all (masked ones hold 0); a sample with
    every position masked is masked."""
    k = remask(k)
    total = spatial.global_pool(k, False)
    masks = k.masks.map(_all_positions)
    if not average:
        return total.replace(masks=masks)
    seen1 = jnp.sum(~k.masks.m1, axis=tuple(range(1, k.masks.m1.ndim))).astype(k.nngp.dtype)
    m2 = k.masks.m2
    seen2 = seen1 if m2 is None else jnp.sum(~m2, axis=tuple(range(1, m2.ndim)))
    seen2 = seen2.astype(k.nngp.dtype)

    def per(a, count):
        return None if a is None else a / jnp.maximum(count, 1)

    pair = seen1[:, None] * seen2[None]
    return total.replace(
        nngp=per(total.nngp, pair),
        ntk=per(total.ntk, pair),
        cov1=per(total.cov1, seen1 * seen1),
        cov2=None if total.cov2 is None else per(total.cov2, seen2 * seen2),
        masks=masks,
    )


def _pool(kind, window_shape, strides, padding, normalize_edges, batch_axis, channel_axis, average):
    fn = f"stax.{kind}"
    _axes_default(fn, batch_axis, channel_axis)
    window = _ints(fn, "window_shape", window_shape)
    strides = (1,) * len(window) if strides is None else _ints(fn, "strides", strides, len(window))
    args = types.SimpleNamespace(
        window_shape=window,
        strides=strides,
        padding=_choice(fn, "padding", padding, windows.PADDINGS),
        normalize_edges=bool(normalize_edges),
    )

    def apply(x):
        pad = args.padding
        if pad == "CIRCULAR":
            x, pad = _circular_pad(x, window, strides), "VALID"
        dims, steps = (1, *window, 1), (1, *strides, 1)
        total = lax.reduce_window(x, 0.0, lax.add, dims, steps, pad)
        if not average:
            return total
        if args.normalize_edges and pad == "SAME":
            ones = jnp.ones((1, *x.shape[1:-1], 1), x.dtype)
            return total / lax.reduce_window(ones, 0.0, lax.add, dims, steps, pad)
        return total / math.prod(window)

    def transform(k):
        _check_spatial(k, kind, len(window))
        _check_windows(k, kind, window, strides, args.padding)
        refuse_channel_masks(k, kind)
        return _strided_masks(spatial.pool(k, args, average), window, strides, args.padding)

    def mask_fn(mask, x):
        return _centres(mask, window, strides, args.padding)

    name = f"{kind}({window}, {strides}, {args.padding})"
    return make_layer(Rule(name, transform, lambda full: True), *stateless(apply), mask_fn)


def AvgPool(
    window_shape,
    strides=None,
    padding="VALID",
    normalize_edges=False,
    batch_axis=0,
    channel_axis=-1,
) -> Layer:
    """Average over windows of positions."""
    return _pool(
        "AvgPool", window_shape, strides, padding, normalize_edges, batch_axis, channel_axis, True
    )


def SumPool(window_shape, strides=None, padding="VALID", batch_axis=0, channel_axis=-1) -> Layer:
    """Sum over windows of positions."""
    return _pool("SumPool", window_shape, strides, padding, False, batch_axis, channel_axis, False)


def _global(kind, batch_axis, channel_axis, average):
    _axes_default(f"stax.{kind}", batch_axis, channel_axis)

    def transform(k):
        if k.masks is None:
            return spatial.global_pool(k, average)
        refuse_channel_masks(k, kind)
        return _masked_global_pool(k, average)

    def apply_fn(params, x, mask=None, **kwargs):
        axes = tuple(range(1, x.ndim - 1))
        if not average:
            return jnp.sum(x, axis=axes)
        # the mean over the unmasked positions (masked entries are 0), as neural-tangents
        return jnp.mean(x, axis=axes) if mask is None else masking.masked_mean(x, mask, axes)

    init_fn, _ = stateless(lambda x: jnp.sum(x, axis=tuple(range(1, x.ndim - 1))))
    rule = Rule(f"{kind}()", transform, lambda full: True, key=(kind,))
    return make_layer(rule, init_fn, apply_fn, masking.positions_all)


def GlobalAvgPool(batch_axis=0, channel_axis=-1) -> Layer:
    """Mean over all positions: (N, *S, C) -> (N, C)."""
    return _global("GlobalAvgPool", batch_axis, channel_axis, True)


def GlobalSumPool(batch_axis=0, channel_axis=-1) -> Layer:
    """Sum over all positions: (N, *S, C) -> (N, C)."""
    return _global("GlobalSumPool", batch_axis, channel_axis, False)


def Flatten(batch_axis=0, batch_axis_out=0) -> Layer:
    """(N, *S, C) -> (N, prod(S)·C); a Dense after it needs only the spatial diagonal."""
    if batch_axis != 0 or batch_axis_out != 0:
        what = f"batch_axis and batch_axis_out must be 0, got {batch_axis!r} and {batch_axis_out!r}"
        raise bad(ValueError, "stax.Flatten", what, "move the batch axis first")

    def transform(k):
        out = spatial.flatten(k)
        if k.masks is None:
            return out
        # a sample is masked when all its positions are (neural-tangents' Dense after its
        # Flatten: masked where every entry is)
        return out.replace(masks=k.masks.map(lambda m: _all_positions(m)))

    rule = Rule("Flatten()", transform, lambda full: False)
    return make_layer(rule, *stateless(lambda x: x.reshape(x.shape[0], -1)), masking.flattened)


def LayerNorm(axis=-1, eps=1e-12, batch_axis=0, channel_axis=-1) -> Layer:
    """(x − mean) / √(var + eps) over ``axis`` (which must hold the channel axis -1)."""
    fn = "stax.LayerNorm"
    _axes_default(fn, batch_axis, channel_axis)
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    eps = check_real(fn, "eps", eps, "pass e.g. eps=1e-12")
    if not all(isinstance(a, int) for a in axes):
        what = f"axis must be an int or a tuple of ints, got {axis!r}"
        fix = "pass e.g. axis=-1"
        raise bad(ValueError, fn, what, fix)

    def normalised(ndim: int) -> tuple[int, ...]:
        """The spatial axes among ``axes`` (0-based among them); ValueError unless the
        channel axis is normalised and the batch axis is not."""
        if any(not -ndim <= a < ndim for a in axes):
            what = f"axis={axis!r} is outside the input's {ndim} axes"
            fix = "pass axis=-1 (channels), or e.g. axis=(1, 2, -1) for positions too"
            raise bad(ValueError, fn, what, fix)
        canonical = {a % ndim for a in axes}
        if ndim - 1 not in canonical or 0 in canonical:
            what = f"axis must hold the channel axis (-1 or {ndim - 1}) and not the batch axis 0"
            what += f", got axis={axis!r}"
            fix = "pass axis=-1 (channels), or e.g. axis=(1, 2, -1) for positions too"
            raise bad(ValueError, fn, what, fix)
        return tuple(sorted(a - 1 for a in canonical if a != ndim - 1))

    def apply(x):
        mean = jnp.mean(x, axis=axes, keepdims=True)
        var = jnp.var(x, axis=axes, keepdims=True)
        return (x - mean) / jnp.sqrt(var + eps)

    def apply_fn(params, x, mask=None, **kwargs):
        if mask is None:
            return apply(x)
        # neural-tangents' masked statistics: sums over the unmasked count; the masked
        # entries (0) are in the variance's sum (a difference that vanishes with the width)
        mean = masking.masked_mean(x, mask, axes, keepdims=True)
        var = masking.masked_mean((x - mean) ** 2, mask, axes, keepdims=True)
        return (x - mean) / jnp.sqrt(var + eps)

    def transform(k):
        _check_gaussian(k, "LayerNorm")
        refuse_channel_masks(k, "LayerNorm")
        return spatial.layer_norm(k, normalised(len(k.spatial) + 2), eps)

    init_fn, _ = stateless(apply)
    return make_layer(Rule(f"LayerNorm({axis}, {eps:g})", transform), init_fn, apply_fn)


def Dropout(rate, mode="train") -> Layer:
    """Dropout with keep rate ``rate`` in (0, 1]; ``mode="test"`` is the identity."""
    fn = "stax.Dropout"
    rate = check_real(
        fn,
        "rate",
        rate,
        "pass the keep rate in (0, 1], e.g. rate=0.9",
        open_low=True,
        high=1.0 + 1e-12,
    )
    mode = _choice(fn, "mode", mode, ("train", "test"))
    if mode == "test" or rate == 1.0:
        return make_layer(Rule(f"Dropout({rate:g}, {mode})", lambda k: k), *stateless(lambda x: x))

    def init_fn(key, input_shape):
        return input_shape, ()

    def apply_fn(params, x, rng=None, **kwargs):
        if rng is None:
            what = "apply_fn in train mode needs rng="
            fix = "pass rng=jax.random.PRNGKey(0), or mode='test'"
            raise bad(ValueError, fn, what, fix)
        keep = jax.random.bernoulli(rng, rate, x.shape)
        return jnp.where(keep, x / rate, 0)

    def transform(k):
        if k.is_input:
            what = "Dropout cannot act on the network's input"
            fix = "put it after a layer"
            raise bad(ValueError, "kernel_fn", what, fix)
        return spatial.dropout(k, rate, same=k.same_samples())

    return make_layer(Rule(f"Dropout({rate:g}, train)", transform), init_fn, apply_fn)
