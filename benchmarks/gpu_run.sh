#!/usr/bin/env bash
# Issue 5's GPU checks in one command, for a lent device machine (an H200: its python3 holds
# torch, triton, transformers, safetensors, tokenizers and jinja2; fla is carried as a wheel).
# Prepared, not yet run (no device has been lent to this project so far):
#   here, once:  echo /.whl/ >> .git/info/exclude
#                python3 -m pip download --no-deps -d .whl fla-core==0.6.0    (pure Python)
#   then:        the device tool's run, carry [".whl"], command "bash benchmarks/gpu_run.sh"
# Prints, and writes under $OUT: fla's kernels against the torch ones (float32 and bf16), the
# Triton paged-decode attention against the naive reference on the GPU, then the 9B-shaped
# engine benchmark: greedy tokens torch vs fla DeltaNet kernels and sdpa vs triton attention with
# static decode (CUDA graphs) off / on, images/s and tokens/s against transformers' generate in
# the same run, and decode-only steps against the HBM roofline.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d)}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -m vlbatch.operators.kernels.delta_rule 2>&1 | tee "$OUT/kernels.txt"
python3 tests/test_kernels_attention_triton.py cuda 2>&1 | tee "$OUT/attention.txt"
python3 -m benchmarks.bench_engine_gpu --check-kernels --check-backends --vs-transformers 8 --attention triton \
  --static-decode --peak-gbs 4800 --dir /tmp/ckpt9b 2>&1 | tee "$OUT/bench_9b.txt"
