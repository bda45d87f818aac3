"""Parameter subsets (``wrt=``): the kernel of the selected leaves against a float64
Jacobian contraction of the model as a function of those leaves alone, the others held
fixed; a partition's kernels summing to the whole kernel; the blocked engine, ``out=``
with resume, per-leaf kernels and ``plan()`` on a subset."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ntk_core
import reference
from core_zoo import ZOO, apply_fn, inputs
from ntk_core._impl.registry import REGISTRY

HEAD = ("Dense_0",)  # the tokens model's output head
# (zoo model, wrt as path names or a predicate on the key path)
CASES = [
    ("mlp", "Dense_1"),
    ("mlp", lambda path: path[-1] == "bias"),
    ("lenet", ["Conv_1", "Dense_2/kernel"]),
    ("tokens", lambda path: path[0] in ("Embed_0", "LayerNorm_0")),
    ("batchnorm_eval", ["BatchNorm_0"]),
    ("tied", "Dense_0"),
    ("dict_input", "Dense_1"),
]


def _selected(params, wrt) -> list[bool]:
    """The leaves ``wrt`` selects, decided here from the key paths, independently."""
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path)
        if callable(wrt):
            out.append(bool(wrt(names)))
        else:
            text = "/".join(map(str, names))
            wanted = [wrt] if isinstance(wrt, str) else wrt
            out.append(any(text == w or text.startswith(w + "/") for w in wanted))
    return out


def _reference(f, params, wrt, x1, x2, **axes):
    """The float64 NTK of ``f`` as a function of the selected leaves (a list)."""
    leaves, tree = jax.tree.flatten(params)
    chosen = _selected(params, wrt)
    assert any(chosen) and not all(chosen)  # a real subset

    def of_subset(sub, x):
        it = iter(sub)
        return f(
            tree.unflatten([next(it) if c else v for v, c in zip(leaves, chosen, strict=True)]), x
        )

    sub = [v for v, c in zip(leaves, chosen, strict=True) if c]
    return reference.ntk(of_subset, sub, x1, x2, **axes)


@pytest.mark.parametrize("implementation", list(REGISTRY))
@pytest.mark.parametrize("name, wrt", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_subset_kernel_is_the_subsets_jacobian_contraction(name, wrt, implementation):
    entry = ZOO[name]
    f, (x1, x2) = apply_fn(entry), inputs(entry)
    expected = _reference(f, entry.params, wrt, x1, x2, trace_axes=())
    got = ntk_core.empirical_ntk(
        f, entry.params, x1, x2, trace_axes=(), implementation=implementation, wrt=wrt
    )
    for g, e in zip(jax.tree.leaves(got), expected, strict=True):
        reference.assert_close(g, e)


def test_a_partition_sums_to_the_whole_kernel():
    entry = ZOO["lenet"]
    f, (x1, _) = apply_fn(entry), inputs(entry, n1=5)
    whole = np.asarray(ntk_core.empirical_ntk(f, entry.params, x1), np.float64)
    convs = ntk_core.empirical_ntk(f, entry.params, x1, wrt=lambda path: path[0][:4] == "Conv")
    dense = ntk_core.empirical_ntk(f, entry.params, x1, wrt=["Dense_0", "Dense_1", "Dense_2"])
    reference.assert_close(np.asarray(convs, np.float64) + dense, whole)


def test_blocked_out_file_and_resume_on_a_subset(tmp_path):
    entry = ZOO["mlp"]
    f = apply_fn(entry)
    x1, x2 = inputs(entry, n1=7, n2=5)
    expected = _reference(f, entry.params, "Dense_0", x1, x2)[0]
    path = str(tmp_path / "k.npy")
    options = dict(wrt="Dense_0", batch_size=3, out=path)
    k = ntk_core.empirical_ntk(f, entry.params, x1, x2, **options)
    reference.assert_close(k, expected)
    again = ntk_core.empirical_ntk(f, entry.params, x1, x2, resume=True, **options)
    np.testing.assert_array_equal(again, k)
    options["wrt"] = "Dense_1"  # another subset is another kernel: not this file's
    with pytest.raises(ValueError, match="empirical_ntk: .*wrt"):
        ntk_core.empirical_ntk(f, entry.params, x1, x2, resume=True, **options)


def test_per_leaf_kernels_of_a_subset_hold_none_at_the_other_leaves():
    entry = ZOO["mlp"]
    f, (x1, x2) = apply_fn(entry), inputs(entry)
    whole = ntk_core.empirical_ntk_per_leaf(f, entry.params, x1, x2)
    sub = ntk_core.empirical_ntk_per_leaf(f, entry.params, x1, x2, wrt="Dense_1")
    assert sub["Dense_0"] == {"bias": None, "kernel": None}
    for leaf in ("bias", "kernel"):
        np.testing.assert_allclose(sub["Dense_1"][leaf], whole["Dense_1"][leaf], rtol=1e-6)


def test_plan_and_cost_scale_with_the_subset():
    entry = ZOO["lenet"]
    f, (x1, _) = apply_fn(entry), inputs(entry, n1=4)
    whole = ntk_core.plan(f, entry.params, x1, implementation="jacobian")
    head = ntk_core.plan(f, entry.params, x1, implementation="jacobian", wrt="Dense_2")
    assert [leaf.path for leaf in head.leaves] == ["['Dense_2']['bias']", "['Dense_2']['kernel']"]
    # the forward pass stays whole: the head's 85 parameters cost a third of all 0.1 M
    assert head.estimates[0].flops < whole.estimates[0].flops / 2
    assert head.estimates[0].memory_bytes < whole.estimates[0].memory_bytes / 2


def test_pseudo_ntk_of_a_subset():
    entry = ZOO["mlp"]
    f, (x1, x2) = apply_fn(entry), inputs(entry)
    (full,) = _reference(f, entry.params, "Dense_1", x1, x2, trace_axes=())  # (N1, N2, O, O)
    got = ntk_core.empirical_pntk(f, entry.params, x1, x2, wrt="Dense_1")
    reference.assert_close(got, full.sum(axis=(2, 3)) / full.shape[2])


def test_a_name_for_params_that_are_one_array_is_refused_with_a_fix():
    f = lambda w, x: jnp.tanh(x @ w)  # noqa: E731
    with pytest.raises(ValueError, match=r"wrt names 'w', which no .* Fix: pass params as a dict"):
        ntk_core.empirical_ntk(f, jnp.ones((3, 2)), jnp.ones((4, 3)), wrt=["w"])
