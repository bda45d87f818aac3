"""Requests that cannot fit in memory are refused before anything runs (they end in an
out-of-memory kill, or on XLA CPU a hang, otherwise); requests that fit still run and
match the float64 reference. Capacities are patched small where the figure is not the
point, so the kernels stay tiny."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ntk_core
import reference
from ntk_core._jax import memory as _memory
from ntk_core._units import human_bytes


def _apply(p, x):
    return jnp.tanh(x @ p["w"]) @ p["v"]


PARAMS = {"w": jnp.linspace(-0.5, 0.5, 24).reshape(3, 8), "v": jnp.linspace(-1.0, 1.0, 8)[:, None]}
N = 300
X = jax.random.normal(jax.random.PRNGKey(0), (N, 3))
KERNEL = N * N * 4  # the (N, N) float32 NTK (O = 1)


def _capacity(monkeypatch, nbytes, host=None):
    monkeypatch.setattr(_memory, "capacity", lambda device=None: nbytes)
    monkeypatch.setattr(_memory, "host_memory", lambda: nbytes if host is None else host)


MIB = 2**20
UNLIMITED_V1 = "9223372036854771712\n"  # v1's "no limit": 2**63 rounded down to a page
V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNTS = (
    "24 23 0:21 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n"
    "31 24 0:27 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:9 - cgroup cgroup rw,cpu,cpuacct\n"
    "35 24 0:31 / /sys/fs/cgroup/memory rw,relatime shared:13 - cgroup cgroup rw,memory\n"
    "36 24 0:32 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
)


def _fake_root(tmp_path, files: dict[str, str]) -> str:
    """A file tree standing for "/": /proc/self/cgroup, mountinfo, the cgroup files."""
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


def _ram() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


SLURM_V2 = "system.slice/slurmstepd.scope/job_7/step_0/user/task_0"  # 0::/ + this


@pytest.mark.parametrize(
    "files, expected",
    [
        pytest.param({}, _ram, id="no-cgroup-files"),
        pytest.param({"sys/fs/cgroup/memory.max": "max\n"}, _ram, id="v2-max-is-unlimited"),
        pytest.param(  # no /proc/self/cgroup or mountinfo: the mount points' own limits
            {"sys/fs/cgroup/memory/memory.limit_in_bytes": f"{300 * MIB}\n"}, 300 * MIB,
            id="v1-mount-point-without-proc",
        ),
        pytest.param(  # the job's limit two levels above the process's cgroup
            {
                "proc/self/cgroup": f"0::/{SLURM_V2}\n",
                "proc/self/mountinfo": V2_MOUNT,
                "sys/fs/cgroup/system.slice/memory.max": "max\n",
                "sys/fs/cgroup/system.slice/slurmstepd.scope/job_7/memory.max": f"{400 * MIB}\n",
                "sys/fs/cgroup/system.slice/slurmstepd.scope/job_7/memory.swap.max": "0\n",
                f"sys/fs/cgroup/{SLURM_V2}/memory.max": "max\n",
                "proc/meminfo": "MemTotal: 9 kB\nSwapTotal:  2048 kB\n",
            },
            400 * MIB, id="v2-nested-job-limit-no-swap",
        ),
        pytest.param(  # memory.high below memory.max; swap allowed up to 1 MiB of 2 MiB
            {
                "proc/self/cgroup": "0::/kubepods/pod1/c1\n",
                "proc/self/mountinfo": V2_MOUNT,
                "sys/fs/cgroup/kubepods/pod1/memory.max": f"{500 * MIB}\n",
                "sys/fs/cgroup/kubepods/pod1/c1/memory.high": f"{350 * MIB}\n",
                "sys/fs/cgroup/kubepods/pod1/c1/memory.swap.max": f"{MIB}\n",
                "proc/meminfo": "SwapTotal:  2048 kB\n",
            },
            351 * MIB, id="v2-memory-high-and-swap-max",
        ),
        pytest.param(  # a cgroup namespace: the process's cgroup is the mount's "/"
            {
                "proc/self/cgroup": "0::/\n",
                "proc/self/mountinfo": V2_MOUNT,
                "sys/fs/cgroup/memory.max": f"{200 * MIB}\n",
            },
            200 * MIB, id="v2-namespace-root",
        ),
        pytest.param(  # moved out of its namespace: only the mount point's files are seen
            {
                "proc/self/cgroup": "0::/../other\n",
                "proc/self/mountinfo": V2_MOUNT,
                "sys/fs/cgroup/memory.max": f"{250 * MIB}\n",
                "sys/fs/cgroup/other/memory.max": f"{10 * MIB}\n",
            },
            250 * MIB, id="v2-outside-namespace",
        ),
        pytest.param(  # hybrid host: v1's memory controller counts, not the unified "0::"
            {
                "proc/self/cgroup": "5:memory:/slurm/uid_1/job_7/step_0\n"
                "3:cpu,cpuacct:/slurm/uid_1/job_7/step_0\n0::/other\n",
                "proc/self/mountinfo": V1_MOUNTS,
                "sys/fs/cgroup/memory/memory.limit_in_bytes": UNLIMITED_V1,
                "sys/fs/cgroup/memory/slurm/uid_1/job_7/memory.limit_in_bytes": f"{450 * MIB}\n",
                "sys/fs/cgroup/memory/slurm/uid_1/job_7/memory.memsw.limit_in_bytes": f"{452 * MIB}\n",
                "sys/fs/cgroup/memory/slurm/uid_1/job_7/step_0/memory.limit_in_bytes": UNLIMITED_V1,
                "sys/fs/cgroup/unified/other/memory.max": f"{MIB}\n",
                "proc/meminfo": "SwapTotal:  8192 kB\n",
            },
            452 * MIB, id="v1-nested-job-limit-memsw",
        ),
        pytest.param(  # a container without a cgroup namespace: its cgroup mounted as "/"
            {
                "proc/self/cgroup": "4:memory:/docker/abc\n",
                "proc/self/mountinfo": "40 31 0:35 /docker/abc /cg\\040v1 ro - cgroup cgroup rw,memory\n",
                "cg v1/memory.limit_in_bytes": f"{150 * MIB}\n",
            },
            150 * MIB, id="v1-container-mount-root",
        ),
    ],
)  # fmt: skip
def test_host_memory_is_the_own_cgroups_limit(monkeypatch, tmp_path, files, expected):
    """The smallest limit from the process's own cgroup (/proc/self/cgroup) up to the mount
    point (/proc/self/mountinfo), plus the swap it may use, or RAM + swap without one; the
    file tree is a fake one under tmp_path. The expected figures are the files' own."""
    monkeypatch.setattr(_memory.sys, "platform", "linux")
    expected = expected() if callable(expected) else expected  # RAM: no limit, no swap
    assert _memory.host_memory(_fake_root(tmp_path, files)) == expected


def test_a_call_beyond_the_jobs_cgroup_limit_is_refused(monkeypatch, tmp_path):
    """The issue's case, small: implementation="jacobian" needs the kernel twice and its
    per-sample Jacobians (P = 32, O = 1); a job limit one byte short of that, far below the
    machine's RAM, refuses the call with its fix instead of an out-of-memory kill."""
    need = 2 * KERNEL + N * 32 * 4
    files = {
        "proc/self/cgroup": "0::/job/step\n",
        "proc/self/mountinfo": V2_MOUNT,
        "sys/fs/cgroup/job/memory.max": f"{need - 1}\n",
    }
    root, real = _fake_root(tmp_path, files), _memory.host_memory
    monkeypatch.setattr(_memory, "host_memory", lambda: real(root))
    with pytest.raises(ValueError, match=rf"holds {need} bytes at once .* more than the host's"):
        ntk_core.empirical_ntk(_apply, PARAMS, X, implementation="jacobian")


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
    # "auto" planned tiles (issue 51): the fix names their batch size
    assert re.search(r"batch_size=(\d+|'auto')", str(e.value)), str(e.value)
    assert "out='kernel.npy'" in str(e.value)
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
    fix = r"Fix: pass batch_size=('auto' \(tiles, the same kernel\)|\d+ \(tiles of \d+ samples)"
    assert re.search(fix, str(e.value)) and str(e.value).endswith(
        "See docs/errors.md#out-of-memory."
    )


def test_a_refusal_names_the_tiles_that_fit_and_they_run(monkeypatch):
    """Issue 51: a one-call refusal names batch_size=B, B from the cost model's tiled
    estimate within the device's capacity, with its estimated time; at that capacity the
    call with batch_size=B runs and gives the reference's kernel."""
    kernel_fn = ntk_core.ntk_fn(_apply, implementation="jacobian")
    _capacity(monkeypatch, KERNEL // 2, host=10 * KERNEL)
    with pytest.raises(ValueError, match=r"this call holds .*, more than the host's") as e:
        kernel_fn(PARAMS, X, X[::-1])
    found = re.search(
        r"Fix: pass batch_size=(\d+) \(tiles of \1 samples, the same kernel; "
        r"estimated ~[0-9.e+-]+ s\)",
        str(e.value),
    )
    assert found, str(e.value)
    b = int(found.group(1))
    assert 1 <= b < N
    tiled = ntk_core.empirical_ntk(
        _apply, PARAMS, X, X[::-1], implementation="jacobian", batch_size=b
    )
    reference.assert_close(np.asarray(tiled), reference.ntk(_apply, PARAMS, X, X[::-1])[0])


#: XLA's figure in the refusal of a compiled program: need (arguments, output, temporaries).
_XLA = (
    r"implementation='structured' needs (.+?) at once for its contraction as XLA "
    r"compiled it \(arguments (\d+) bytes, output (\d+) bytes, temporaries (\d+) bytes\), "
    r"more than the host's (\d+) bytes"
)


def test_xla_temporaries_beyond_capacity_are_refused_before_running(monkeypatch):
    """Issue 51: the memory model counts the kernel (x2 given: once; "structured"'s features
    are not known without a trace), XLA's compiled contraction also holds its terms (two
    kernel-sized temporaries here): at twice the kernel the model passes and XLA's figure,
    read once compiled, refuses the call before it runs, naming that figure; at exactly
    that figure the call runs and gives the reference's kernel, and ``"auto"`` at twice
    the kernel computes it in tiles on the device instead of refusing."""
    x2 = X[::-1]
    expected = reference.ntk(_apply, PARAMS, X, x2)[0]
    _capacity(monkeypatch, 2 * KERNEL, host=10 * KERNEL)
    with pytest.raises(ValueError, match="^ntk_fn: " + _XLA) as e:
        ntk_core.ntk_fn(_apply, implementation="structured")(PARAMS, X, x2)
    need, *parts = re.search(_XLA, str(e.value)).groups()
    arguments, output, temporaries, have = map(int, parts)
    assert need == human_bytes(arguments + output + temporaries), need
    assert output >= KERNEL and have == 2 * KERNEL
    need = arguments + output + temporaries
    assert need > 2 * KERNEL  # what the memory model alone let through
    fix = "or implementation='jacobian' or 'ntvp' in one call"
    assert "Fix: pass batch_size=" in str(e.value) and fix in str(e.value)
    _capacity(monkeypatch, need, host=10 * KERNEL)
    kernel = ntk_core.ntk_fn(_apply, implementation="structured")(PARAMS, X, x2)
    reference.assert_close(kernel, expected)
    _capacity(monkeypatch, 2 * KERNEL, host=10 * KERNEL)
    tiled = ntk_core.ntk_fn(_apply)(PARAMS, X, x2)
    assert isinstance(tiled, jax.Array)
    reference.assert_close(tiled, expected)


#: What XLA TPU's compiler raised for issue 51's FCN 3072-2048x3-8 (16 x 16, "jacobian").
_TPU_SAYS = (
    "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
    "temporaries (20.02G) exceeds available HBM (15.75G)."
)


def test_a_program_the_compiler_refuses_is_refused_with_its_words(monkeypatch):
    """XLA TPU compiles no program that does not fit the chip: its RESOURCE_EXHAUSTED
    comes from compiling, before any memory analysis (faked here for every program): an
    explicit implementation is refused quoting XLA, ``"auto"`` computes the kernel in
    tiles on the device and it equals the reference's."""
    from ntk_core._impl import base

    monkeypatch.setattr(base, "_memory_analysis", lambda jitted, a, k: RuntimeError(_TPU_SAYS))
    x = X[:40]
    match = "^empirical_ntk: implementation='jacobian' does not fit the device for its features: "
    with pytest.raises(
        ValueError, match=match + re.escape(f"XLA says {_TPU_SAYS[:-1]!r}. Fix: pass batch_size=")
    ):
        ntk_core.empirical_ntk(_apply, PARAMS, x, implementation="jacobian")
    tiled = ntk_core.empirical_ntk(_apply, PARAMS, x)
    assert isinstance(tiled, jax.Array)
    reference.assert_close(tiled, reference.ntk(_apply, PARAMS, x, None)[0])


def test_a_gram_matrix_is_held_twice_with_its_mirror(monkeypatch):
    """x2=None: the kernel and its mirror (K + Kᵀ)/2 exist at once, so 1.5x the kernel is
    too little; with x2 given, or at 2x, the call runs and gives the reference's kernel.
    The memory model alone: as on a backend without XLA's memory analysis (its figure,
    with the contraction's temporaries, is tested below)."""
    monkeypatch.setattr(_memory, "compiled_bytes", lambda stats: None)
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
    O = 1 here); "structured", at the same capacity, runs and gives the reference's kernel
    (the memory model alone, without XLA's figure: as in the test above)."""
    monkeypatch.setattr(_memory, "compiled_bytes", lambda stats: None)
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
