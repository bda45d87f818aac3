"""Requests that cannot fit in memory are refused before anything runs (they end in an
out-of-memory kill, or on XLA CPU a hang, otherwise); requests that fit still run and
match the float64 reference. Capacities are patched small where the figure is not the
point, so the kernels stay tiny."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ntk_core
import reference
from ntk_core._jax import memory as _memory


def _apply(p, x):
    return jnp.tanh(x @ p["w"]) @ p["v"]


PARAMS = {"w": jnp.linspace(-0.5, 0.5, 24).reshape(3, 8), "v": jnp.linspace(-1.0, 1.0, 8)[:, None]}
N = 300
X = jax.random.normal(jax.random.PRNGKey(0), (N, 3))
KERNEL = N * N * 4  # the (N, N) float32 NTK (O = 1)


def _capacity(monkeypatch, nbytes, host=None):
    monkeypatch.setattr(_memory, "capacity", lambda device=None: nbytes)
    monkeypatch.setattr(_memory, "host_memory", lambda: nbytes if host is None else host)


def test_host_memory_is_ram_or_cgroup_limit_plus_swap(monkeypatch):
    files = {
        "/sys/fs/cgroup/memory.max": "1000000\n",
        "/proc/meminfo": "MemTotal: 9 kB\nSwapTotal:  2 kB\nSwapFree: 1 kB\n",
    }
    monkeypatch.setattr(_memory, "_read", lambda path: files.get(path, ""))
    monkeypatch.setattr(_memory.sys, "platform", "linux")
    _memory.host_memory.cache_clear()
    try:
        assert _memory.host_memory() == 1_000_000 + 2048
        files["/sys/fs/cgroup/memory.max"] = "max\n"
        _memory.host_memory.cache_clear()
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        assert _memory.host_memory() == ram + 2048
    finally:
        _memory.host_memory.cache_clear()


def test_a_kernel_larger_than_this_machine_is_refused_before_it_runs():
    """The real capacities: N chosen so that the (N, N) float32 kernel alone exceeds the
    device's and the host's; the inputs are a few MB and nothing of the kernel's size is
    allocated."""
    have = [_memory.capacity(), _memory.host_memory()]
    if None in have:
        pytest.skip("the system does not report its memory")
    n = int((max(have) / 4) ** 0.5) + 1000
    x = jnp.zeros((n, 3))
    with pytest.raises(ValueError, match=r"empirical_ntk: this call holds .* GiB at once") as e:
        ntk_core.empirical_ntk(_apply, PARAMS, x)
    assert "batch_size='auto'" in str(e.value) and "out='kernel.npy'" in str(e.value)
    with pytest.raises(ValueError, match=r"empirical_ntk: the kernel is .*, more than the host"):
        ntk_core.empirical_ntk(_apply, PARAMS, x, batch_size="auto")


@pytest.mark.parametrize("kind", ["ntk", "nngp", "per_leaf"])
def test_one_call_over_capacity_is_refused(monkeypatch, kind):
    fn = {"ntk": ntk_core.ntk_fn, "nngp": ntk_core.nngp_fn, "per_leaf": ntk_core.ntk_per_leaf_fn}
    kernel_fn = fn[kind](_apply)
    _capacity(monkeypatch, KERNEL // 2, host=10 * KERNEL)
    with pytest.raises(
        ValueError, match=r"this call holds .* at once.*, more than the host's"
    ) as e:
        kernel_fn(PARAMS, X, X[::-1])
    fix = "Fix: pass batch_size='auto' (tiles, the same kernel)."
    assert str(e.value).endswith(f"{fix} See docs/errors.md#out-of-memory.")


def test_a_gram_matrix_is_held_twice_with_its_mirror(monkeypatch):
    """x2=None: the kernel and its mirror (K + Kᵀ)/2 exist at once, so 1.5x the kernel is
    too little; with x2 given, or at 2x, the call runs and gives the reference's kernel."""
    f = ntk_core.ntk_fn(_apply, implementation="structured")  # features of unknown size
    _capacity(monkeypatch, KERNEL * 3 // 2)
    expected = rf"holds {2 * KERNEL} bytes at once \(the kernel {KERNEL} bytes twice \(with"
    with pytest.raises(ValueError, match=expected):
        f(PARAMS, X)
    x2 = X[::-1]
    reference.assert_close(f(PARAMS, X, x2), reference.ntk(_apply, PARAMS, X, x2)[0])
    _capacity(monkeypatch, 2 * KERNEL)
    reference.assert_close(f(PARAMS, X), reference.ntk(_apply, PARAMS, X, None)[0])


def test_the_jacobian_contraction_also_holds_its_per_sample_jacobians(monkeypatch):
    """implementation="jacobian" holds N·O·P per-sample Jacobians beside the kernel (P = 32,
    O = 1 here); "structured", at the same capacity, runs and gives the reference's kernel."""
    jacobians = N * 32 * 4
    _capacity(monkeypatch, 2 * KERNEL + jacobians - 1)
    match = rf"the kernel {KERNEL} bytes twice \(with its mirror\) and the features of its "
    with pytest.raises(ValueError, match=match + rf"{N} samples {jacobians} bytes"):
        ntk_core.empirical_ntk(_apply, PARAMS, X, implementation="jacobian")
    k = ntk_core.empirical_ntk(_apply, PARAMS, X, implementation="structured")
    reference.assert_close(k, reference.ntk(_apply, PARAMS, X, None)[0])


def test_blocked_result_over_host_memory_is_refused_and_out_runs(monkeypatch, tmp_path):
    _capacity(monkeypatch, KERNEL // 2)
    with pytest.raises(
        ValueError, match=r"the kernel is .*, more than the host's .* Fix: pass out="
    ):
        ntk_core.empirical_ntk(_apply, PARAMS, X, batch_size=64)
    with pytest.raises(ValueError, match=r"more than the host's .* Fix: pass out=.* instead"):
        ntk_core.empirical_ntk(_apply, PARAMS, X, batch_size=64, store_on_device=True)
    written = ntk_core.empirical_ntk(_apply, PARAMS, X, batch_size=64, out=tmp_path / "k.npy")
    reference.assert_close(np.asarray(written), reference.ntk(_apply, PARAMS, X, None)[0])


class _Accelerator:
    platform = "gpu"

    def __init__(self, limit):
        self.limit = limit

    def memory_stats(self):
        return None if self.limit is None else {"bytes_limit": self.limit}


def test_accelerators_hold_the_sum_of_their_allocator_limits():
    assert _memory.capacity([_Accelerator(3 * 2**30), _Accelerator(5 * 2**30)]) == 8 * 2**30
    assert _memory.capacity([_Accelerator(3 * 2**30), _Accelerator(None)]) is None


def test_sketch_features_over_capacity_are_refused_and_out_runs(monkeypatch, tmp_path):
    key = jax.random.PRNGKey(3)
    whole = ntk_core.ntk_sketch_fn(_apply, k=256, key=key)
    expected = np.asarray(whole(PARAMS, X))  # Φ (N, k) float32 fits
    assert expected.shape == (N, 256)
    _capacity(monkeypatch, N * 256 * 4 - 1)
    with pytest.raises(ValueError, match=r"Φ of 300 samples x k=256 is .*, more than the host's"):
        whole(PARAMS, X)
    blocked = ntk_core.ntk_sketch_fn(_apply, k=256, key=key, batch_size=100)
    with pytest.raises(ValueError, match=r"Fix: pass out='phi.npy' \(written block by block\)"):
        blocked(PARAMS, X)
    path = tmp_path / "phi.npy"
    to_file = ntk_core.ntk_sketch_fn(_apply, k=256, key=key, batch_size=100, out=path)
    np.testing.assert_allclose(to_file(PARAMS, X), expected, rtol=1e-5, atol=1e-6)


def test_sketched_kernel_over_capacity_is_refused(monkeypatch):
    """Φ (N, 16) fits, the (N, N) Θ̂ = Φ Φᵀ does not: the fix is the low-rank posterior."""
    _capacity(monkeypatch, KERNEL - 1)
    key = jax.random.PRNGKey(4)
    with pytest.raises(ValueError, match=r"Θ̂ of 300 x 300 samples is .*low_rank_inference"):
        ntk_core.empirical_ntk_sketch(_apply, PARAMS, X, k=16, key=key)
    _capacity(monkeypatch, KERNEL)
    sketch = ntk_core.empirical_ntk_sketch(_apply, PARAMS, X, k=16, key=key)
    np.testing.assert_allclose(sketch.kernel, sketch.features1 @ sketch.features2.T, rtol=1e-6)
