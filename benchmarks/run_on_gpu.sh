#!/bin/bash
# What a lent GPU machine runs first (benchmarks/README.md, "On a GPU"): each check bounded by its own timeout,
# in the order of what it is worth, every result written to $OUT as it comes (a cut-off run keeps what it has).
#   bash benchmarks/run_on_gpu.sh        (from the repository root; wheels in .whl/ are installed first)
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
LOG=$OUT/run.log
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD
fi
{ date; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, transformers, peft, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__, 'peft', peft.__version__, 'triton', triton.__version__)"; } >"$LOG" 2>&1
step() { local limit=$1; shift; echo "=== $* (limit ${limit}s) $(date +%T)" >>"$LOG"
         timeout "$limit" "$@" >>"$LOG" 2>&1; echo "=== exit $? $(date +%T)" >>"$LOG"; }
# 1. the time model's stages, measured (issue 27 item 2c); predictions are added afterwards on any machine
step ${T_STEP:-270} python3 benchmarks/step_time_gpu.py --profile --out-dir "$OUT"
# 2. the user's path and the CUDA-only code paths, run for real
step ${T_TESTS:-140} python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_static_cache.py \
    tests/test_logprobs_triton.py tests/test_offload.py tests/test_rewards.py -k "cuda or triton or graph or gpu"
# the GPU decode step's Triton kernels and grpo-nb's own static step (never run on a GPU before), fp16 and bf16
step ${T_DECODE:-90} python3 -m pytest -q -p no:cacheprovider tests/test_decode_triton.py tests/test_rms_norm_triton.py
# 3. the kernels and the offload against their baselines
step ${T_KERNEL:-60} python3 benchmarks/logprobs_kernel.py --out "$OUT/logprobs_kernel.json"
step ${T_OFFLOAD:-60} python3 benchmarks/offload.py --out "$OUT/offload.json"
