#!/usr/bin/env bash
# The kpool GPU suite and kernel benchmark, as one command for the device tool (H200):
#   run(command="bash tests/gpu/run_all.sh", kind="nvidia-h200-x2")   # add carry=[".whl"] if wheels travel
# It installs nothing; a missing Python package travels as wheels in .whl/ (see the device README), which
# this script installs first when present:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site
# The repository root goes on PYTHONPATH (the package is not installed there). Outputs under $OUT (or
# ./gpu-out): device.txt, pytest_gpu.log, bench.log, bench/kernels.{json,txt,png}. The table comes last.
set -uo pipefail
cd "$(dirname "$0")/../.."
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT/bench"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
  "cuda devices", torch.cuda.device_count())'; } > "$OUT/device.txt" 2>&1
# GPU_TESTS narrows the tests (default: tests/gpu and the gpu-marked QSA tests); BENCH_ONLY the bench cases.
python3 -m pytest -q -m gpu ${GPU_TESTS:-tests/gpu tests/test_qsa_*.py} -p no:cacheprovider -rs 2>&1 | tee "$OUT/pytest_gpu.log"
tests_rc=${PIPESTATUS[0]}
python3 bench/kernels.py --out "$OUT/bench" ${BENCH_ONLY:+--only "$BENCH_ONLY"} 2>&1 | tee "$OUT/bench.log" > /dev/null
bench_rc=${PIPESTATUS[0]}
echo "== device"; cat "$OUT/device.txt"
echo "== gpu tests (rc $tests_rc): $(tail -n 1 "$OUT/pytest_gpu.log")"
echo "== kernel bench (rc $bench_rc)"; cat "$OUT/bench/kernels.txt" 2>/dev/null || tail -n 30 "$OUT/bench.log"
exit $(( tests_rc || bench_rc ))
