#!/usr/bin/env bash
# The GPU checks in one go (issue 19), for any session that is lent a CUDA GPU; about
# 10 minutes on one H200. Run from the repository root on the GPU machine:
#
#     bash benchmarks/gpu_checks.sh            # writes $OUT (default gpu_results/)
#
# dm-haiku is not installed there: the checks below need only jax, flax and this
# project. What it runs, each with its own time limit so that one slow step cannot eat
# the others':
#   1. ntk doctor (the environment: CUDA, jaxlib, precision of the matmuls);
#   2. the reference grid on the GPU, a subset (float64 references on the host);
#   3. first call / warm call of the MLP and LeNet (benchmarks/first_call.py, ours);
#   4. the 30 000 x 30 000 MLP kernel written to a file (benchmarks/bench_out_of_core.py),
#      with the in-memory 10 000 x 10 000 rate and a kill-and-resume.
# Device memory: XLA_PYTHON_CLIENT_PREALLOCATE=false, so JAX's peak_bytes_in_use is the
# kernel's, not a preallocated pool. Record the figures in benchmarks/README.md with the
# device name (printed by step 1).
set -u
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
python -m pip install -q -e . --no-deps >/dev/null 2>&1 || true
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc in $((SECONDS - start)) s; tail:"
  tail -n 15 "$OUT/$name.log" | sed 's/^/   /'
}
step doctor 60 python -m ntk_core._cli doctor
step reference_grid 180 python -m pytest -q -x -p no:cacheprovider \
  tests/core/test_reference_grid.py -k "x2_given and (mlp or lenet)"
step first_call 150 python benchmarks/first_call.py --repeats 1 --out "$OUT/first_call.json"
step out_of_core 240 python benchmarks/bench_out_of_core.py --n 30000 --n-memory 10000 --repeat 1 \
  --folder "$OUT" --out "$OUT/out_of_core.json"
rm -f "$OUT"/ntk_bench_*.npy "$OUT"/ntk_bench_*.manifest.json
echo "== done; results in $OUT"
