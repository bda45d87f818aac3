#!/usr/bin/env bash
# The accelerator checks, for any session that is lent a CUDA GPU or a TPU. Run from the
# repository root on that machine, all steps or some of them (one call of the device tool
# is limited to 10 minutes: split the steps over two calls there):
#
#     bash benchmarks/accelerator_checks.sh [doctor precision grid grid_conv first_call out_of_core memory]
#
# On a TPU v5e (2026-12-06) programs compile slowly (a LeNet kernel at "highest": 45 s):
# run "doctor precision", "grid", "grid_conv", "first_call out_of_core" as four calls.
#
# Logs and JSON go to $OUT (default accelerator_results/). Where .whl-tpu/ holds wheels
# (flax, optax, dm-haiku, equinox and what they need, for a machine without a package
# index: benchmarks/README.md says how to fetch them), they are installed under
# /tmp/site first. The steps, each with its own time limit so one slow step cannot eat
# the others':
#   doctor       ntk doctor (platform, jaxlib, the precision of matmuls);
#   precision    benchmarks/accelerator_precision.py: Flax models written without
#                precision=, every implementation, on the device vs a float64 reference
#                computed on the host (TPUs multiply float32 in bf16 passes by default);
#   grid         the reference grid's first file (tokens, BatchNorm, tied weights), one
#                process (a TPU is held by one program at a time), references on the host;
#   grid_conv    its second file (LeNet, CNN, MLP, dict inputs) and Flax = Haiku;
#   first_call   first / warm call of the MLP, LeNet and ResNet-18 (first_call.py, ours);
#   out_of_core  the 30 000 x 30 000 MLP kernel written to a file, the in-memory
#                10 000 x 10 000 rate and a kill-and-resume (bench_out_of_core.py).
#   memory       the out-of-memory guard: refusals past the device's capacity, peak
#                memory and closed-form errors below it (accelerator_memory.py).
# XLA_PYTHON_CLIENT_PREALLOCATE=false, so JAX's peak_bytes_in_use is the kernel's on a GPU.
set -u
OUT=${OUT:-accelerator_results}
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
if [ -d .whl-tpu ]; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps \
    --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-tpu/*.whl || exit 1
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc in $((SECONDS - start)) s; tail:"
  tail -n 25 "$OUT/$name.log" | sed 's/^/   /'
}
for s in "${@:-doctor precision grid grid_conv first_call out_of_core memory}"; do for s in $s; do case $s in
  doctor) step doctor 150 python -m ntk_cli.cli doctor ;;
  precision) step precision 400 python benchmarks/accelerator_precision.py --n 16 \
    --implementations jacobian structured ntvp --precisions highest --nngp \
    --out "$OUT/precision.json" ;;
  grid) step grid 560 python -m pytest -v -rf -p no:cacheprovider \
    tests/core/test_reference_grid.py ;;
  grid_conv) step grid_conv 560 python -m pytest -v -rf -p no:cacheprovider \
    tests/core/test_reference_grid_conv.py tests/cross_framework/test_flax_vs_haiku.py ;;
  first_call) step first_call 300 python benchmarks/first_call.py --repeats 1 \
    --cases mlp1 lenet resnet18 --out "$OUT/first_call.json" ;;
  out_of_core) step out_of_core 270 python benchmarks/bench_out_of_core.py --n 30000 \
    --n-memory 10000 --repeat 1 --folder "$OUT" --out "$OUT/out_of_core.json"
    rm -f "$OUT"/ntk_bench_*.npy "$OUT"/ntk_bench_*.manifest.json ;;
  memory) step memory 300 python benchmarks/accelerator_memory.py --shares 1.02 0.6 0.9 0.97 \
    --out "$OUT/memory.json" ;;
  *) echo "unknown step $s" ;;
esac; done; done
echo "== done; results in $OUT"
