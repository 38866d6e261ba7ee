#!/usr/bin/env bash
# The GPU suite, the kernel benchmark and the transfer benchmark (across two GPUs when there are two), as one command for the
# device tool (H200):
#   run(command="bash tests/gpu/run_all.sh", kind="nvidia-h200-x2")   # add carry=[".whl"] if wheels travel
# It installs nothing; the Python packages the GPU machine lacks (ucxx, a recent grpcio, nixl for the
# NIXL baseline) travel as wheels in .whl/ (../shared/tools/fetch-device-wheels --nixl), which this
# script unpacks first when present, into one folder put first on the path:
#   for w in .whl/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done; export PYTHONPATH=/tmp/site
# The repository root goes on PYTHONPATH (the package is not installed there). Outputs under $OUT (or
# ./gpu-out), at most 8 files as the device tool returns: pytest_gpu.log (device details first), bench.log,
# bench/kernels.{json,txt,png}, transfer/transfer-*.{json,png}. The tables come last. Each step has its own
# deadline (TESTS_TIMEOUT, BENCH_TIMEOUT, TRANSFER_TIMEOUT seconds) so a slow step leaves the others' output;
# SEND_VARIANTS=1 adds the send-variants probe; REPACK_HOST=1 the repack's host and device time (repack_host.txt);
# QSA_VARIANTS=1 the QSA decode update's candidates, three runs in a row (qsa.txt); PROTO_INFO=1 the UCX protocols
# a same-layout and a from-128 pull select at 1,024 tokens (UCX_PROTO_INFO=y, proto.txt); PROGRESS_MODES="auto thread" ucxx's progress modes side by side; SKIP_TESTS, SKIP_BENCH, SKIP_TRANSFER, SKIP_DCP, SKIP_DECODE and SKIP_PREFILL leave a step out (the whole suite takes about 490 s on one
# H200 without pytest-xdist, 2026-12-02: add "-n 8" to GPU_TESTS, or run the benches in a second call);
# NO_NIXL leaves out the transfer bench's NIXL baseline; HOPS=1 adds its hop-by-hop stamps of a pull; KERNELS=N lists the N costliest kernels of a decode and
# a prefill step;
# PREFILL_BLOCK_SIZE (default 128) is the block size of the heterogeneous pull measured beside the 256-token one.
set -uo pipefail
cd "$(dirname "$0")/../.."
if compgen -G ".whl/*.whl" > /dev/null; then
  for w in .whl/*.whl; do python3 -m zipfile -e "$w" /tmp/site || exit 1; done
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT/bench" "$OUT/transfer"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
  "cuda devices", torch.cuda.device_count())'; } > "$OUT/pytest_gpu.log" 2>&1
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
# GPU_TESTS narrows the tests (default: tests/gpu and the gpu-marked QSA tests); BENCH_ONLY the bench cases.
tests_rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  # SIGINT first at the deadline: pytest then prints its summary (-rA: each outcome so far) and where it waited.
  timeout -s INT -k 30 "${TESTS_TIMEOUT:-540}" python3 -m pytest -q -m "gpu and not gpu_whole_device" ${GPU_TESTS:-tests/gpu tests/kernels/test_qsa_*.py} \
    -p no:cacheprovider -rA 2>&1 | tee -a "$OUT/pytest_gpu.log"
  tests_rc=${PIPESTATUS[0]}
  # Tests that read the whole device's memory run after the rest, one at a time (no pytest-xdist worker beside them).
  timeout 120 python3 -m pytest -q -m gpu_whole_device tests/gpu -p no:cacheprovider -rA 2>&1 | tee -a "$OUT/pytest_gpu.log"
  [ "${PIPESTATUS[0]}" -ne 0 ] && tests_rc=1
fi
bench_rc=0
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout "${BENCH_TIMEOUT:-240}" python3 kpool_pd/bench/kernels.py --out "$OUT/bench" ${BENCH_ONLY:+--only "$BENCH_ONLY"} \
    > "$OUT/bench.log" 2>&1
  bench_rc=$?
fi
transfer_rc=0
# The transfer bench: prefill pool on cuda:0, decode pool on cuda:1 with two GPUs, else both on cuda:0
# (two processes on one GPU: cuda_ipc inside the device, the fixed cost of a pull shows the same way).
# The machine's name in the result files is read off the card (the device tool may lend an H100 for an H200).
card=$(python3 -c 'import torch; n = torch.cuda.get_device_name(0).lower(); print(next((c for c in ("h200", "h100") if c in n), "gpu"))' 2>/dev/null || echo gpu)
if [ "$gpus" -ge 2 ]; then placement=(--two-gpu --machine "${card}x2"); else placement=(--machine "$card"); fi
if [ "$gpus" -ge 1 ] && [ -z "${SKIP_TRANSFER:-}" ]; then
  timeout "${TRANSFER_TIMEOUT:-240}" python3 -m kpool_pd.bench.transfer --device cuda "${placement[@]}" --layers 61 \
    --tokens "${TRANSFER_TOKENS:-256,1024,4096,16384,32768}" --reps "${TRANSFER_REPS:-5}" ${NO_NIXL:+--no-nixl} \
    --block-size 256 --prefill-block-size "${PREFILL_BLOCK_SIZE:-128}" ${HOPS:+--hops} \
    --out "$OUT/transfer" >> "$OUT/bench.log" 2>&1
  transfer_rc=$?
fi
dcp_rc=0
# The DCP bench (two GPUs): decode step time of 32k-token contexts at DCP 1 and 2, cache and transfer bytes per
# rank; its table goes to bench.log, its JSON to bench/ (no PNG: the device tool returns 8 files at most).
if [ "$gpus" -ge 2 ] && [ -z "${SKIP_DCP:-}" ]; then
  timeout "${DCP_TIMEOUT:-300}" python3 -m kpool_pd.bench.dcp --device cuda --ranks 1,2 --tokens "${DCP_TOKENS:-32768}" \
    --layers "${DCP_LAYERS:-8}" --batch 4 --no-plot --machine "${card}x2" --out "$OUT/bench" > "$OUT/dcp.txt" 2>&1
  dcp_rc=$?
  cat "$OUT/dcp.txt" >> "$OUT/bench.log"; rm -f "$OUT/dcp.txt"
fi
decode_rc=0
# The decode step bench: eager and graphed steps of 61 layers at batch 1, 16 and 64 (DECODE_BATCHES), kpool and QSA
# (DECODE_FAMILIES); table in decode.txt.
if [ "$gpus" -ge 1 ] && [ -z "${SKIP_DECODE:-}" ]; then
  timeout "${DECODE_TIMEOUT:-300}" python3 -m kpool_pd.bench.decode_step --device cuda --layers "${DECODE_LAYERS:-61}" \
    --batches "${DECODE_BATCHES:-1,16,64}" --families "${DECODE_FAMILIES:-kpool,qsa}" --kernels "${KERNELS:-0}" \
    --out "$OUT/bench" > "$OUT/decode.txt" 2>&1
  decode_rc=$?
fi
prefill_rc=0
# The prefill step bench: one 32k prompt whole and in 2,048-token chunks, per-layer, hoisted and graphed; prefill.txt.
if [ "$gpus" -ge 1 ] && [ -z "${SKIP_PREFILL:-}" ]; then
  timeout "${PREFILL_TIMEOUT:-300}" python3 -m kpool_pd.bench.prefill_step --device cuda --layers "${DECODE_LAYERS:-61}" \
    --prompt-len 32768 --chunk 2048 --kernels "${KERNELS:-0}" > "$OUT/prefill.txt" 2>&1
  prefill_rc=$?
fi
variants_rc=0
# The send-variants probe (SEND_VARIANTS=1): raw ucxx against the connector's posting and pool slices, same bytes,
# one pair of processes on cuda:0 (kpool_pd.bench.send_variants); table in variants.txt.
if [ "$gpus" -ge 1 ] && [ -n "${SEND_VARIANTS:-}" ]; then
  timeout "${VARIANTS_TIMEOUT:-180}" python3 -m kpool_pd.bench.send_variants --device cuda --mib "${VARIANTS_MIB:-41,164}" \
    --reps 9 > "$OUT/variants.txt" 2>&1
  variants_rc=$?
fi
extra_rc=0
# The repack's host time in parts and its launches' device time (REPACK_HOST=1; kpool_pd.bench.repack_host).
if [ "$gpus" -ge 1 ] && [ -n "${REPACK_HOST:-}" ]; then
  timeout 120 python3 -m kpool_pd.bench.repack_host --tokens "${REPACK_TOKENS:-1024,4096,32768}" --reps 200 \
    > "$OUT/repack_host.txt" 2>&1 || extra_rc=1
fi
# The QSA decode update's launch candidates, three runs in a row (QSA_VARIANTS=1; kpool_pd.bench.qsa_update_variants).
if [ "$gpus" -ge 1 ] && [ -n "${QSA_VARIANTS:-}" ]; then
  timeout 180 python3 -m kpool_pd.bench.qsa_update_variants --device cuda > "$OUT/qsa.txt" 2>&1 || extra_rc=1
fi
# Which UCX protocol each pull's send selects (PROTO_INFO=1): the transfer bench at 1,024 tokens, one rep, with
# UCX_PROTO_INFO=y in every process; UCX's protocol lines for messages of 1 MiB and more kept.
if [ "$gpus" -ge 1 ] && [ -n "${PROTO_INFO:-}" ]; then
  timeout 180 env UCX_PROTO_INFO=y python3 -m kpool_pd.bench.transfer --device cuda "${placement[@]}" --layers 61 \
    --tokens 1024 --reps 1 --no-nixl --block-size 256 --prefill-block-size "${PREFILL_BLOCK_SIZE:-128}" \
    --out "$OUT/proto" > "$OUT/proto-raw.txt" 2>&1 || extra_rc=1
  grep -E 'tag|rndv|cuda|MB|GB|inf' "$OUT/proto-raw.txt" | grep -v 'UCX  WARN' | head -n 400 > "$OUT/proto.txt"
  rm -rf "$OUT/proto-raw.txt" "$OUT/proto"
fi
progress_rc=0
# ucxx's progress modes side by side (PROGRESS_MODES="auto thread", PROGRESS_ROUNDS rounds, the modes in turn within a
# round): the transfer bench at TRANSFER_TOKENS with hop stamps, "auto" the connector's own choice (no
# UCXPY_PROGRESS_MODE), any other name given to every process of the run as UCXPY_PROGRESS_MODE; tables in
# progress.txt, the runs' JSON in transfer-progress.tgz.
if [ "$gpus" -ge 1 ] && [ -n "${PROGRESS_MODES:-}" ]; then
  for round in $(seq 1 "${PROGRESS_ROUNDS:-2}"); do
    for mode in $PROGRESS_MODES; do
      if [ "$mode" = auto ]; then mode_env=(); else mode_env=(UCXPY_PROGRESS_MODE="$mode"); fi
      echo "== round $round, progress $mode" >> "$OUT/progress.txt"
      timeout "${TRANSFER_TIMEOUT:-240}" env "${mode_env[@]}" python3 -m kpool_pd.bench.transfer --device cuda \
        "${placement[@]}" --layers 61 --tokens "${TRANSFER_TOKENS:-1024,4096}" --reps "${TRANSFER_REPS:-5}" --no-nixl \
        --block-size 256 --prefill-block-size "${PREFILL_BLOCK_SIZE:-128}" --hops --out "$OUT/progress/$round-$mode" \
        2>&1 | grep -v 'UCX  WARN' >> "$OUT/progress.txt"
      [ "${PIPESTATUS[0]}" -ne 0 ] && progress_rc=1
    done
  done
  tar -czf "$OUT/transfer-progress.tgz" -C "$OUT" progress && rm -rf "$OUT/progress"
fi
up_rc=0
# Warm daemons end to end (UP_RUNS=1): kpool-pd up on cuda, 61 layers, three loads, then the 32k chunked-prefill
# pipeline (SKIP_PIPELINE leaves it out); summaries in up.txt.
if [ "$gpus" -ge 1 ] && [ -n "${UP_RUNS:-}" ]; then
  for load in "--requests 64 --prompt-len 512 --max-tokens 128 --max-running 64" \
              "--requests 1 --prompt-len 512 --max-tokens 128" \
              "--requests 16 --prompt-len 4096 --max-tokens 32 --max-running 16"; do
    echo "== kpool-pd up --device cuda --layers 61 $load" >> "$OUT/up.txt"
    timeout "${UP_TIMEOUT:-240}" python3 -m kpool_pd up --device cuda --layers 61 $load > "$OUT/up-run.txt" 2>&1
    rc=$?; [ $rc -ne 0 ] && up_rc=$rc
    grep -A4 '^summary' "$OUT/up-run.txt" >> "$OUT/up.txt" || tail -n 20 "$OUT/up-run.txt" >> "$OUT/up.txt"
  done
  rm -f "$OUT/up-run.txt"
  if [ -z "${SKIP_PIPELINE:-}" ]; then
    echo "== kpool-pd bench pipeline --device cuda --layers 61 --prompt-len 32768 --max-batch-tokens 2048" >> "$OUT/up.txt"
    timeout "${UP_TIMEOUT:-240}" python3 -m kpool_pd.bench.pipeline --device cuda --layers 61 --prompt-len 32768 \
      --max-batch-tokens 2048 --runs 1 --no-timeline --machine "$card" --out "$OUT/bench" > "$OUT/up-run.txt" 2>&1
    rc=$?; [ $rc -ne 0 ] && up_rc=$rc
    tail -n 6 "$OUT/up-run.txt" >> "$OUT/up.txt"; rm -f "$OUT/up-run.txt"
  fi
fi
echo "== device"; head -n 3 "$OUT/pytest_gpu.log"
echo "== gpu tests (rc $tests_rc): $(tail -n 1 "$OUT/pytest_gpu.log")"
echo "== kernel bench (rc $bench_rc)"; cat "$OUT/bench/kernels.txt" 2>/dev/null || tail -n 30 "$OUT/bench.log"
if [ "$gpus" -ge 1 ] && [ -z "${SKIP_TRANSFER:-}" ]; then
  echo "== transfer bench, $gpus GPU(s) (rc $transfer_rc)"; grep -v '^wrote' "$OUT/bench.log" | tail -n 25
fi
if [ "$gpus" -ge 2 ] && [ -z "${SKIP_DCP:-}" ]; then
  echo "== DCP bench (rc $dcp_rc)"; grep -A6 '^DCP decode step' "$OUT/bench.log" | tail -n 7
fi
if [ "$gpus" -ge 1 ] && [ -z "${SKIP_DECODE:-}" ]; then
  echo "== decode step bench (rc $decode_rc)"; grep -v '^batch' "$OUT/decode.txt" | tail -n $(( ${KERNELS:-0} + 10 ))
fi
if [ "$gpus" -ge 1 ] && [ -z "${SKIP_PREFILL:-}" ]; then
  echo "== prefill step bench (rc $prefill_rc)"; grep -v '^USDT\|^STAGE' "$OUT/prefill.txt" | tail -n 60
fi
if [ -n "${SEND_VARIANTS:-}" ]; then echo "== send variants (rc $variants_rc)"; tail -n 4 "$OUT/variants.txt"; fi
if [ -n "${REPACK_HOST:-}" ]; then echo "== repack host"; cat "$OUT/repack_host.txt"; fi
if [ -n "${QSA_VARIANTS:-}" ]; then echo "== qsa update"; tail -n 11 "$OUT/qsa.txt"; fi
if [ -n "${PROTO_INFO:-}" ]; then echo "== ucx protocols: $(wc -l < "$OUT/proto.txt") lines in proto.txt"; fi
if [ -n "${PROGRESS_MODES:-}" ]; then
  echo "== progress modes (rc $progress_rc)"
  grep -E '^== round|^ucx progress|raw ucxx tag  |connector ucx (push|from 128)? *[0-9]|^ +[0-9]+ tokens:' "$OUT/progress.txt"
fi
if [ -n "${UP_RUNS:-}" ]; then echo "== kpool-pd up (rc $up_rc)"; cat "$OUT/up.txt"; fi
exit $(( tests_rc || bench_rc || transfer_rc || dcp_rc || decode_rc || prefill_rc || variants_rc || progress_rc || up_rc || extra_rc ))
