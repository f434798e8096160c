#!/usr/bin/env bash
# Everything the GPU kernel path needs measured, in one run on a CUDA machine (an H100/H200, no network):
#
#   bash benchmarks/gpu_session.sh            # every step; results under $OUT (if set) or results/gpu
#   bash benchmarks/gpu_session.sh send       # only the steps named (check bench compile send client-cuda dgc)
#
# 1. the device, driver and torch/triton versions;
# 2. correctness: benchmarks/check_kernels.py at 1M, 25M and 100M elements (Triton path vs the torch reference on
#    the GPU: DGC in every configuration, quantizers, scatter-add, a client pipeline with a nack);
# 3. the benchmark: benchmarks/bench_kernels.py at 1M, 25M, 100M with the copy bandwidth measured in the same run,
#    plus the BLOCK x num_warps sweep of the DGC kernels at 100M;
# 4. the compile report of every kernel for this GPU (registers, spills, occupancy, load widths);
# 5. a client's whole send (benchmarks/bench_send_gpu.py): 1M, 11M, 25M, 100M parameters x dgc, dgc+int8, int8, the
#    kernels and the device wire encode against the torch path on the same GPU and the CPU, the encode alone, and
#    the device encode's bytes compared with fedcomp.wire.encode (a difference fails the step);
# 6. when flwr imports (carry its wheels: the machine has no network), the ClientApp's CUDA tests with the
#    compiled kernels (tests/test_client_cuda.py: gpu=true state on the GPU, saved through the CPU, kernels =
#    reference);
# 7. only when named (`bash benchmarks/gpu_session.sh dgc`; meant to stay under about 150 s): the DGC step and a
#    send in one short run: check_kernels at 25M (every DGC path bitwise, the group, the encode's bytes),
#    bench_kernels at 100M (the step against copy and torch.topk, its parts: sample, threshold, the placement of
#    the sent indices and the sort it replaced), the host reads and ops of one 25M send (--count) with the host's
#    own time per function (--profile: where the send's fixed cost goes), the whole send of dgc and dgc+int8 at
#    25M (kernels, torch path, cpu) and the host's own time of that send by hop (--host).
#
# Needs only torch, triton and numpy (fedcomp's kernel path and pipeline import nothing else). Every step runs even
# when one before it failed (GPU time is scarce: one run should say all it can); the exit status is 1 when any
# step failed, and the last line names them. check.json says which case disagreed. Record the tables in
# docs/results.md with the device name.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-results/gpu}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
if ! command -v nvidia-smi >/dev/null || ! "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
  echo "gpu_session.sh: no CUDA device here (it needs one); on a CPU the kernels are checked by make test" >&2
  exit 1
fi

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
} | tee "$OUT/device.txt"

failed=()
wanted=("$@")
step() {  # step NAME LOG COMMAND...: run it (if named, or none named), its output shown and kept in LOG; remember a
  local name=$1 log=$2; shift 2  # failure and go on
  if ((${#wanted[@]})) && [[ " ${wanted[*]} " != *" $name "* ]]; then return 0; fi
  echo "== $name"
  "$@" 2>&1 | tee "$log" || failed+=("$name")
}
step check "$OUT/check.txt" "$PY" benchmarks/check_kernels.py --sizes 1M,25M,100M --json "$OUT/check.json"
step bench "$OUT/bench.txt" "$PY" benchmarks/bench_kernels.py --sizes 1M,25M,100M --sweep --json "$OUT/bench.json"
arch=$("$PY" -c 'import torch; a, b = torch.cuda.get_device_capability(); print(10 * a + b)')
step compile "$OUT/compile.txt" "$PY" -m fedcomp.kernels.compile_check --arch "$arch" --json "$OUT/compile.json"
step send "$OUT/send.txt" "$PY" benchmarks/bench_send_gpu.py --sizes 1M,11M,25M,100M --json "$OUT/send.json"
if ((${#wanted[@]})) && [[ " ${wanted[*]} " == *" dgc "* ]]; then  # 7: only when named
  step dgc "$OUT/dgc_check.txt" "$PY" benchmarks/check_kernels.py --sizes 25M --json "$OUT/dgc_check.json"
  step dgc "$OUT/dgc_bench.txt" "$PY" benchmarks/bench_kernels.py --sizes 100M --json "$OUT/dgc_bench.json"
  step dgc "$OUT/dgc_count.txt" "$PY" benchmarks/bench_send_gpu.py --count --profile 30 --sizes 25M \
    --compressors dgc,dgc+int8
  step dgc "$OUT/dgc_send.txt" "$PY" benchmarks/bench_send_gpu.py --sizes 25M --compressors dgc,dgc+int8 \
    --json "$OUT/dgc_send.json"
  step dgc "$OUT/dgc_host.txt" "$PY" benchmarks/bench_send_gpu.py --host --sizes 25M --compressors dgc,dgc+int8
fi
if ((${#wanted[@]})) && [[ " ${wanted[*]} " != *" client-cuda "* ]]; then
  :
elif "$PY" -c 'import flwr' 2>/dev/null; then
  step client-cuda "$OUT/client_cuda.txt" "$PY" -m pytest -q -p no:cacheprovider tests/test_client_cuda.py
else
  echo "flwr not installed: skipped tests/test_client_cuda.py (the pipeline on the GPU was checked above)" \
    | tee "$OUT/client_cuda.txt"
fi
echo "results in $OUT"
if ((${#failed[@]})); then
  echo "failed steps: ${failed[*]}"
  exit 1
fi
