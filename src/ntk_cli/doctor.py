"""``ntk doctor``'s check that needs the adapters: the same network in Flax and in Haiku,
with transplanted weights, gives the same NTK."""

from __future__ import annotations

import functools

import jax

from ntk_core import _doctor as core
from ntk_core._doctor import MODELS, Check, CheckResult


def _twins(out_features: int, model: str):
    """A Flax module and the Haiku function of the same network."""
    import flax.linen as nn
    import haiku as hk

    import ntk_flax
    import ntk_haiku

    if model == MODELS[0]:
        haiku_lenet = functools.partial(ntk_haiku.lenet, out_features=out_features)
        return ntk_flax.LeNet(out_features), haiku_lenet

    class Small(nn.Module):  # Flax names the layers Conv_0 and Dense_0; both pad "SAME"
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(2, (5, 5))(x))
            return nn.Dense(out_features)(x.reshape((x.shape[0], -1)))

    def small(x):  # the Flax names, so that the transplant keeps them
        x = jax.nn.relu(hk.Conv2D(2, 5, name="Conv_0")(x))
        return hk.Linear(out_features, name="Dense_0")(x.reshape((x.shape[0], -1)))

    return Small(), small


def frameworks_check(samples: int = 4, image_size: int = 16, model: str = MODELS[0]) -> Check:
    """The Flax network and its Haiku twin with transplanted weights give the same NTK."""

    def run() -> CheckResult:
        missing = [m for m in ("flax", "haiku") if not core._installed(m)]
        if missing:
            return CheckResult("", "skip", f"{' and '.join(missing)} not installed")
        import haiku as hk

        import ntk_flax
        import ntk_haiku

        x1, x2 = core._inputs(samples, image_size)
        flax_model, haiku_fn = _twins(2, model)
        variables = jax.jit(flax_model.init)(jax.random.PRNGKey(0), x1)
        net = hk.without_apply_rng(hk.transform(haiku_fn))
        params = ntk_haiku.params_from_flax(variables["params"])
        k_flax = ntk_flax.kernel(flax_model, variables, x1, x2, trace_axes=())
        k_haiku = ntk_haiku.kernel(net, params, x1, x2, trace_axes=())
        pairs = {"haiku vs flax": (k_haiku, k_flax)}
        return core._compare(pairs, str(k_flax.dtype), f"{model}, full kernel; ")

    return Check("Flax equals Haiku (same weights)", run)


def all_checks(samples: int = 4, image_size: int = 16, model: str = MODELS[0]) -> list[Check]:
    """:func:`ntk_core._doctor.default_checks` with the Flax = Haiku check third."""
    checks = core.default_checks(samples, image_size, model)
    return [*checks[:2], frameworks_check(samples, image_size, model), *checks[2:]]
