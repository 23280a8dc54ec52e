#!/usr/bin/env bash
# One prepared GPU check of h3 on whatever GPUs are visible; every report under one folder.
#
#   scripts/gpu_check.sh [OUTPUT_DIR]        (default outputs/gpu-check-<UTC time>)
#
# Steps (each runs even if an earlier one failed; their exit codes are in summary.txt):
#   1. environment: GPUs, driver, torch, CUDA
#   2. the GPU test tier (pytest tests/gpu)
#   3. h3 verify on CUDA at the counts that fit (NCCL, bf16)
#   4. h3 bench-transport at 1 rank with H3's real shapes (864x480, 141 frames, 56 x 128 heads)
#   5. NVFP4 linear benchmark at H3 shapes: bf16 GEMM vs the NVFP4 path, TFLOP/s
#   6. h3 generate on the h3-2blocks preset (real widths and sequence, 2 of 50 blocks, synthetic
#      weights), with --parity (at one GPU: Ulysses vs tensor mode, the identity path)
#   7. h3's SDPA rule on this GPU for that run (sdpa-rule.json: the fused kernels allowed)
#   8. the fp4 GEMM self-test in its own process (fp4-selftest.json: accepted, or the refused
#      shape and the fallback; on a GPU without fp4 it says so and the check expects the bf16 path)
#   9. the kernels of a step at the real shapes (kernels.json, scripts/bench_gpu_kernels.py): SDPA as
#      h3 calls it at 17,608 and 73,514 rows (56 and 7 heads) against each allowed fused kernel alone,
#      and each block linear's quantizer (fused and eager) against its fp4 GEMM and the bf16 GEMM
#  10. --compile on the h3-2blocks preset (compile.json, scripts/bench_compile.py): the compile time
#      apart, then eager and compiled steps alternating, median of 3 runs each, their ratio and the
#      latents' relative difference (the GPU test tier already checked it against the bound)
# Sized to finish in under 10 minutes on one H200.
#
# JSON reports get stdout only (stderr, e.g. warnings, goes to the step's .log beside them), so
# they always parse. The script exits 1 when a step failed or a check of the reports failed: SDPA
# ran an unfused (math) kernel on any rank at H3's shapes, or a fused kernel h3's rule does not
# allow on this GPU at the run's length (sdpa-rule.json: e.g. cuDNN attention below cuDNN 9.15.1;
# h3core.model.attention.sdpa_rule.choose_sdpa_backends), or an NVFP4 linear on any rank took another path
# than the one this GPU should take (cuda-fp4-scaled-mm on compute capability >= 10 with a torch
# that has float4 and an fp4 GEMM self-test that passed, fp4-selftest.json; else cuda-dequant-bf16).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
failed=0
record() {  # record NAME RC SECONDS WHERE
  printf '%-16s rc=%-3s %4ss  %s\n' "$1" "$2" "$3" "$4" | tee -a "$summary"
  [ "$2" -eq 0 ] || failed=1
}
step() {  # step NAME LOGFILE COMMAND...: run, keep its output (stdout and stderr), record its exit code
  local name=$1 log=$2 start=$SECONDS
  shift 2
  "$@" >"$log" 2>&1
  record "$name" $? "$((SECONDS - start))" "$log"
}
step_json() {  # step_json NAME JSONFILE COMMAND...: stdout to the JSON file, stderr to NAME.log
  local name=$1 json=$2 start=$SECONDS
  shift 2
  "$@" >"$json" 2>"${json%.json}.log"
  record "$name" $? "$((SECONDS - start))" "$json"
}
export PYTHONUNBUFFERED=1

step environment "$out/environment.txt" bash -c 'nvidia-smi; python -c "import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"gpus\", torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], \"capability\", torch.cuda.get_device_capability(0))"'
step_json versions "$out/versions.json" python - <<'PY'
import ctypes, json, torch
def cublaslt():
    for name in ("libcublasLt.so", "libcublasLt.so.13", "libcublasLt.so.12"):
        try:
            return ctypes.CDLL(name).cublasLtGetVersion()
        except (OSError, AttributeError):
            pass
    return None
nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                  "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl, "cublaslt": cublaslt(),
                  "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                  "capability": list(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None}))
PY
step gpu-tests "$out/gpu-tests.log" python -m pytest -q -rs tests/gpu
step_json verify "$out/verify.json" h3 verify --device cuda --output "$out/verify" --json
step_json bench-transport "$out/bench-transport.json" h3 bench-transport 1 sdpa --device cuda --width 864 --height 480 --frames 141 --iters 20 --json
step nvfp4-linear "$out/nvfp4-linear.log" python scripts/bench_nvfp4_linear.py --device cuda --tokens 4096 --repeat 20 --json "$out/nvfp4-linear.json"
step_json generate "$out/generate.json" h3 generate --device cuda --preset h3-2blocks --steps 4 --parity --no-save-latents --output "$out/generate" --json
step_json dry-run-vs-measured "$out/dry-run-vs-measured.json" python -m h3core.generate.dryrun "$out/generate.json"
step_json sdpa-rule "$out/sdpa-rule.json" python -m h3core.verify.gpu_reports --sdpa-rule "$out/generate.json"
# H3's four block linears at one GPU's rows (14,855) and eight GPUs' (1,857), after the defaults
h3_shapes="1,256,128;77,1024,512;128,512,1024;300,2048,5376;1857,5376,7168"
for m in 14855 1857; do h3_shapes="$h3_shapes;$m,21504,5376;$m,5376,7168;$m,28672,5376;$m,5376,14336"; done
step_json fp4-selftest "$out/fp4-selftest.json" python -m h3core.nvfp4.selftest --device cuda:0 --shapes "$h3_shapes"
step kernels "$out/kernels.log" python scripts/bench_gpu_kernels.py --repeat 10 --json "$out/kernels.json"
step compile "$out/compile.log" python scripts/bench_compile.py --device cuda --preset h3-2blocks --steps 3 --repeat 3 --json "$out/compile.json"

expected=$(python - "$out/fp4-selftest.json" <<'PY'
import json, sys, torch
try:
    accepted = json.load(open(sys.argv[1])).get("accepted", False)
except (OSError, ValueError):  # no record: the step failed (summary.txt says so); expect the fallback
    accepted = False
fp4 = torch.cuda.get_device_capability(0) >= (10, 0) and hasattr(torch, "float4_e2m1fn_x2") and accepted
print("cuda-fp4-scaled-mm" if fp4 else "cuda-dequant-bf16")
PY
)
python -m h3core.verify.gpu_reports "$out" "$expected" "$out/sdpa-rule.json" | tee -a "$summary"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
echo "reports in $out"
exit "$failed"
