#!/usr/bin/env bash
# The cuda backend's GPU check in stages: about 5 minutes on one H200 (every limit: 8 min).
#
#   bash scripts/gpu_check.sh              # on the lent GPU machine, from the repository root
#   bash scripts/gpu_check.sh --dry-run    # on a CPU: every stage's plumbing (host emulator)
#
# With the device tool (from a session whose task drew a GPU), carrying the wheels and the real
# exports (written here first: `python scripts/export_real_sets.py .gpu-real`, stage 5d):
#   run(command="bash scripts/gpu_check.sh", carry=[".whl", ".gpu-real"], timeout_s=540)
#
# Each stage of scripts/gpu_stages.py (`python scripts/gpu_stages.py plan` lists them with their
# limits) runs in its own process under its own limit: at the limit it gets SIGINT (it writes a
# "timeout" line with what it has; pytest would still write its report), 15 s later SIGKILL.
# A failing stage does not stop the next. Under $OUT (else ./gpu_check_out):
#   stages.jsonl  one JSON line per result as soon as it exists, one final line per stage
#   summary.md    stage | status (ok/failed/skipped/timeout) | seconds | key numbers or error,
#                 rewritten after every line
#   results.json, results.md   the benchmark stage's table (for docs/benchmarks.md), as before
#   gpu_check.log everything printed
#   cudnn_errors.log, nccl.*.log   cuDNN's (CUDNN_LOGERR_DBG) and NCCL's (NCCL_DEBUG=WARN) own logs
# Stages: 0-versions, 1-kernels (NVRTC per family + 12 one-node kernels vs numpy), 2-capture
# (pinned buffers, events, captured copy+kernel replayed, invalidated capture -> CaptureError),
# 3-cudnn (every cuDNN graph kind x fp32/fp16/bf16 vs numpy, captured and replayed), 4-models
# (mlp, lenet, transformer: forward, 5 steps, replay), 4b-models-tf32-off (the same with
# NVIDIA_TF32_OVERRIDE=0 and cuDNN's non-deterministic engines deselected), 5-convnets (resnet,
# mobilenet), 5b-precision-export, 5c-nccl (a world of 1 through the NCCL all-reduce captured
# in the step's graph == without it, bit for bit), 5d-real-exports (a dynamo CNN, BERT, Llama
# at opset 23, a BiLSTM: 3 SGD steps vs numpy), 6-benchmark (ResNet-50 shaped + model_zoo, tr_onnx fp32/fp16/bf16 vs torch AMP
# channels_last eager; torch.compile last). tests/test_cuda_gpu.py (pytest -m gpu) calls the
# same parity functions, for a developer on a GPU; this script does not run it.
#
# The machine has Python 3.12, cupy-cuda13x 14.2, nvidia-cudnn-cu13, torch 2.11 (cu130),
# onnxruntime (CPU) and no internet. What is missing is installed from wheels carried in
# .whl/ (ignored by git), only where `import` fails there:
#   nvidia-cudnn-frontend==1.32.0   (module cudnn; not in the image; the cp312 wheel is 11.1 MiB, the
#                                   one that must be carried)
#   cuda-bindings==13.0.3           (the image has one; carried in case it does not import)
#   onnx==1.23.2                    (the image has 1.23.1)
#   pluggy==1.6.0
#   ml_dtypes==0.5.4               (bfloat16; onnx brings it, carried in case the image lacks it)
#   nvidia-cuda-runtime==13.5.37   (only its include/ is used, for cuda_fp16.h/cuda_bf16.h, when
#                                   NVRTC finds no CUDA headers there)
# Fetch them here, in the repository root (x86-64, CPython 3.12, manylinux):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64 \
#     --platform manylinux_2_34_x86_64 -d .whl \
#     nvidia-cudnn-frontend==1.32.0 cuda-bindings==13.0.3 onnx==1.23.2 pluggy==1.6.0 \
#     ml_dtypes==0.5.4 nvidia-cuda-runtime==13.5.37
# tr_onnx itself: `pip install --no-deps --no-build-isolation -e .` (falls back to
# PYTHONPATH=repo root).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=""
[ "${1:-}" = "--dry-run" ] && DRY="--dry-run"
OUT_DIR="${OUT:-./gpu_check_out}"
mkdir -p "$OUT_DIR"
exec > >(tee -a "$OUT_DIR/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
START=$(date +%s)
echo "== gpu_check ${DRY:-(GPU)} $(date -u +%FT%TZ) in $PWD"
rm -f "$OUT_DIR/stages.jsonl" "$OUT_DIR/summary.md"
if [ -z "$DRY" ]; then
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

# -- install what is missing ---------------------------------------------------------------
SITE=/tmp/tr_onnx_site
missing=()
need() {  # need MODULE WHEEL-PREFIX
    if ! $PY -c "import $1" >/dev/null 2>&1; then
        whl=$(ls .whl/"$2"-*.whl 2>/dev/null | head -n1)
        if [ -n "$whl" ]; then missing+=("$whl"); else echo "!! $1 missing and no .whl/$2-*.whl"; fi
    fi
}
need cudnn nvidia_cudnn_frontend
need cuda.bindings cuda_bindings
need onnx onnx
need pluggy pluggy
need ml_dtypes ml_dtypes
if [ ${#missing[@]} -gt 0 ]; then
    echo "== installing ${missing[*]}"
    if $PY -m pip --version >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "${missing[@]}"
    else  # an interpreter without pip: a wheel is a zip archive of what goes in site-packages
        echo "== no pip: unpacking the wheels into $SITE"
        $PY - "$SITE" "${missing[@]}" <<'PYEOF'
import sys, zipfile
for whl in sys.argv[2:]:
    zipfile.ZipFile(whl).extractall(sys.argv[1])
PYEOF
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# The frontend finds libcudnn only under the interpreter's purelib (or on LD_LIBRARY_PATH, which
# it searches first), and cuDNN finds cuBLAS through RUNPATHs relative to its own folder; name
# both folders of the installed wheels, or cuDNN aborts the process at its first matmul plan.
libdirs=$($PY - <<'PYEOF'
import glob, os, site, sysconfig
roots = [sysconfig.get_path("purelib"), *site.getsitepackages()]
found = []
for pattern in ("nvidia/cudnn/lib/libcudnn.so.9", "nvidia/*/lib/libcublasLt.so.*"):
    for root in roots:
        hits = sorted(glob.glob(os.path.join(root, pattern)))
        if hits:
            found.append(os.path.dirname(hits[0]))
            break
print(":".join(dict.fromkeys(found)))
PYEOF
)
[ -n "$libdirs" ] && export LD_LIBRARY_PATH="$libdirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "== LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
if ! $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1; then
    echo "== pip install -e . failed; using PYTHONPATH"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the kernels include cuda_fp16.h / cuda_bf16.h: without a toolkit or the runtime wheel's
# headers, unpack only include/ from the carried wheel (its libraries stay out of the way)
if ! $PY -c "from tr_onnx.backends.cuda.sources import cuda_include_dir as d; d()" 2>/dev/null; then
    whl=$(ls .whl/nvidia_cuda_runtime-*.whl 2>/dev/null | head -n1)
    if [ -n "$whl" ]; then
        $PY - "$whl" <<'PYEOF'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
for name in z.namelist():
    if "/include/" in name:
        z.extract(name, "/tmp/tr_onnx_cuda_headers")
PYEOF
        hdr=$(find /tmp/tr_onnx_cuda_headers -name cuda_fp16.h | head -n1)
        [ -n "$hdr" ] && export CUDA_PATH="$(dirname "$(dirname "$hdr")")"
        echo "== CUDA headers from $whl: CUDA_PATH=${CUDA_PATH:-none}"
    else
        echo "!! no CUDA headers and no .whl/nvidia_cuda_runtime-*.whl"
    fi
fi
$PY -c "import tr_onnx, cupy, cudnn, onnx; from tr_onnx.backends.cuda.backend import cuda_unavailable_reason as r
print('tr_onnx', tr_onnx.__file__, '| cupy', cupy.__version__, '| cudnn frontend',
      cudnn.__version__, '| onnx', onnx.__version__, '| cuda:', r() or 'usable')"

fi  # installs: the GPU machine only (the dry run uses this machine's environment)
# cuDNN's and NCCL's own error logs go into the output folder with the rest
export CUDNN_LOGERR_DBG=1 CUDNN_LOGDEST_DBG="$OUT_DIR/cudnn_errors.log"
export NCCL_DEBUG=WARN NCCL_DEBUG_FILE="$OUT_DIR/nccl.%h.%p.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# -- the stages ------------------------------------------------------------------------------
failed=0
while read -r name limit envs; do
    t0=$(date +%s)
    echo "== stage $name (limit ${limit}s${envs:+; $envs})"
    # shellcheck disable=SC2086  # envs: KEY=VALUE words
    timeout -s INT -k 15 "$limit" env $envs $PY scripts/gpu_stages.py run "$name" \
        --out "$OUT_DIR" $DRY </dev/null
    rc=$?
    $PY scripts/gpu_stages.py close "$name" --rc $rc --seconds $(( $(date +%s) - t0 )) \
        --out "$OUT_DIR" $DRY </dev/null
    [ $rc -ne 0 ] && failed=1
    echo "== stage $name rc=$rc after $(( $(date +%s) - t0 ))s (total $(( $(date +%s) - START ))s)"
done < <($PY scripts/gpu_stages.py plan)
cat "$OUT_DIR/summary.md" 2>/dev/null
cat "$OUT_DIR/results.md" 2>/dev/null
exit $failed
