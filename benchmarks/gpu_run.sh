#!/usr/bin/env bash
# The GPU run (issue 30) in one command, for a lent device machine that gets a copy of this working tree
# (not an installed project) and a python3 holding torch, triton, transformers, numba, numpy, pillow,
# safetensors, tokenizers, jinja2, pyarrow, fsspec and pyyaml: no ray, pydantic, decord, av, s3fs or
# blake3, and no network. Nothing the steps import goes beyond these and the carried wheels.
#
# Prepare here, once (the device reaches no package registry):
#   bash benchmarks/gpu_wheels.sh      # fla-core, einops, blake3, xgrammar (cp312) into .whl/ (git-ignored)
# then the device tool's run: carry [".whl"], command "bash benchmarks/gpu_run.sh", timeout_s 480.
# The CPU rehearsal (tests/test_gpu_run.py runs it in a venv holding only the packages above):
#   python3 -m benchmarks.device_env /tmp/devenv --wheels /tmp/devwhl
#   PATH=/tmp/devenv/bin:$PATH WHEELS=/tmp/devwhl OUT=/tmp/out bash benchmarks/gpu_run.sh --rehearse
#
# `vlbatch.*` is imported from the tree itself: benchmarks/tree_site.py writes a temp folder of
# symlinks mirroring setup.py's mapping (put on PYTHONPATH; why not `pip install -e`: its docstring)
# and unzips the carried wheels into it. Steps, cheapest first; each writes its files under $OUT as
# soon as it ends (a run stopped by its time limit keeps what it measured):
#   00_check     one line: python, torch + CUDA + free GPU memory, triton, transformers, carried wheels,
#                the tree's import, and what is missing (a fatal gap stops the run here)
#   01_parity    greedy tokens of our engine vs transformers on tiny dense / tied / MoE checkpoints,
#                teacher-forced logits of both against transformers in float32
#   02_kernels   fla / Triton attention / MoE kernels vs their references
#   02b_decode   video.decode_device: cuda (TorchCodec / NVDEC in the model stage) vs the CPU stage's decode on
#                bench_video_decode's clips: wall, CPU s, frames/s, bit-exactness (benchmarks/gpu_decode.py);
#                one "skipped: why" line where TorchCodec or FFmpeg's libraries cannot load there
#   03_nine_b    9B shape: engine vs transformers generate (images/s, tokens/s, CUDA graphs off/on,
#                decode vs the HBM roofline), video QA caches on/off, peak memory vs the plan
#   04_structured constrained decoding (benchmarks/bench_structured.py): free vs JSON schema vs choices at
#                batch 64, the step split (mask fill, mask apply, rest) and whether the CPU's mask fill is
#                hidden behind the GPU's forward; "skipped: no xgrammar ..." (exit 0) where not carried
# --rehearse: every step on the CPU at tiny shapes (float32), no CUDA needed.
# Environment: OUT (default: a temp folder), WHEELS (default .whl), PYTHON (default python3),
# CKPT_DIR (the 9B checkpoint, default /tmp/ckpt9b: reused by a rerun on a warm machine).
# Exit status 0 when every step passed; $OUT/summary.txt names each step's exit status.
set -uo pipefail
cd "$(dirname "$0")/.."
REHEARSE=0
[[ "${1:-}" == "--rehearse" ]] && REHEARSE=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1 \
  HF_HUB_DISABLE_PROGRESS_BARS=1
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
SITE=$(mktemp -d "${TMPDIR:-/tmp}/vlbatch-site.XXXXXX")
WORK=$(mktemp -d "${TMPDIR:-/tmp}/vlbatch-run.XXXXXX")
trap 'rm -rf "$SITE" "$WORK"' EXIT

wheels=()
for w in "$WHEELS"/*.whl; do
  [[ -e "$w" ]] || continue
  # on the CPU, fla would make transformers' Qwen3.5 (the parity reference) call GPU-only kernels
  [[ $REHEARSE == 1 && "$(basename "$w")" == fla_core-* ]] && continue
  wheels+=("$w")
done
"$PY" benchmarks/tree_site.py "$SITE" "${wheels[@]}" > "$OUT/00_site.txt" 2>&1 || { cat "$OUT/00_site.txt"; exit 1; }
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

if [[ $REHEARSE == 1 ]]; then
  export OMP_NUM_THREADS=1  # tiny shapes: one thread each is fastest and fair to a shared runner
  CHECK=(--cpu)
  PARITY=(--device cpu --dtype float32 --new-tokens 8)
  KERNELS=(--device cpu)
  NINE_B=(--shape tiny --device cpu --dtype float32 --dir "$WORK/ckpt" --kv-gb 0.0625 --variants auto,auto+static
          --requests 3 --new-tokens 4 --size 64 --videos 1 --questions 3 --frames 4 --video-new-tokens 3
          --hf-batches 1,3 --hf-images 3)
  DECODE=(--device cpu --clips tiny --cache "$WORK/clips")
  STRUCT=(--device cpu --shape tiny --requests 4 --new-tokens 8)
  LIMITS=(0 0 0 0 0)  # no step limit: the test's own timeout bounds the rehearsal
else
  command -v nvidia-smi > /dev/null && nvidia-smi > "$OUT/00_nvidia_smi.txt" 2>&1
  CHECK=()
  PARITY=(--device cuda --dtype bfloat16 --new-tokens 32)
  KERNELS=(--device cuda)
  NINE_B=(--device cuda --dtype bfloat16 --dir "${CKPT_DIR:-/tmp/ckpt9b}" --memory-fraction 0.85 --peak-gbs 4800)
  DECODE=(--device cuda --cache "$WORK/clips")
  STRUCT=(--device cuda --dtype bfloat16 --requests 64 --new-tokens 64)
  LIMITS=(150 120 420 180 150)
fi

FAILED=()
# step NAME LIMIT_S CMD...: the output goes to the terminal and $OUT/NAME.txt; LIMIT_S 0 = none
step() {
  local name=$1 limit=$2 rc
  shift 2
  echo "== $name: $*"
  if [[ $limit == 0 ]]; then "$@" 2>&1 | tee "$OUT/$name.txt"; else timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"; fi
  rc=${PIPESTATUS[0]}
  echo "$name: exit $rc" >> "$OUT/summary.txt"
  [[ $rc == 0 ]] || { FAILED+=("$name"); echo "== $name failed (exit $rc)"; }
  return "$rc"
}

step 00_check 60 "$PY" -m benchmarks.gpu_check "${CHECK[@]}" --json "$OUT/00_check.json" || exit 1
step 01_parity "${LIMITS[0]}" "$PY" -m benchmarks.gpu_parity "${PARITY[@]}" --json "$OUT/01_parity.json"
if [[ $REHEARSE == 1 ]]; then
  # bf16 on the CPU parts at near-ties (tiny random models have flat logits): the device run's report
  # path (first divergence, both logits, router margins) runs here too; its verdict is not the test's
  step 01b_parity_bf16 0 "$PY" -m benchmarks.gpu_parity --device cpu --dtype bfloat16 --new-tokens 16 --report-only \
    --json "$OUT/01b_parity_bf16.json"
fi
if [[ $REHEARSE == 1 ]]; then
  # Triton runs on the CPU only in its interpreter, which must be on before triton is imported
  step 02_kernels 0 env TRITON_INTERPRET=1 "$PY" -m benchmarks.gpu_kernels "${KERNELS[@]}" --json "$OUT/02_kernels.json"
else
  step 02_kernels "${LIMITS[1]}" "$PY" -m benchmarks.gpu_kernels "${KERNELS[@]}" --json "$OUT/02_kernels.json"
fi
step 02b_decode "${LIMITS[3]}" "$PY" -m benchmarks.gpu_decode "${DECODE[@]}" --json "$OUT/02b_decode.json"
step 03_nine_b "${LIMITS[2]}" "$PY" -m benchmarks.gpu_nine_b --out "$OUT" "${NINE_B[@]}"
step 04_structured "${LIMITS[4]}" "$PY" -m benchmarks.bench_structured "${STRUCT[@]}" --json "$OUT/04_structured.json"

if (( ${#FAILED[@]} )); then
  echo "failed steps: ${FAILED[*]} (files under $OUT)"
  exit 1
fi
echo "every step passed; files under $OUT"
