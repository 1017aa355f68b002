#!/usr/bin/env bash
# The cuda backend's GPU check: one command, under 8 minutes on one H200.
#
#   bash scripts/gpu_check.sh          # on the lent GPU machine, from the repository root
#
# With the device tool (from a session whose task drew a GPU), carrying the wheels:
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
#
# Writes under $OUT (else ./gpu_check_out): gpu_check.log (everything), pytest_gpu.xml,
# results.json and results.md (parity table + benchmark table, rewritten after every row).
# Steps: (a) pytest -m gpu tests/test_cuda_gpu.py -- parity with the numpy backend on the
# model_zoo models (forward, gradients, 20 SGD steps, fp32; 10 steps fp16 and bf16 against the
# fp32 curve; the model trained on cuda, exported, run by onnxruntime) and CUDA-graph replay ==
# eager; (b) scripts/gpu_check.py --benchmark -- images/s
# and peak GPU memory, tr_onnx cuda (fp32, fp16, bf16) vs PyTorch (fp32 eager, AMP fp16/bf16
# channels_last eager and torch.compile reduce-overhead) on a ResNet-50-shaped net (plain
# torch, exported at run time) and the model_zoo models.
#
# The machine has Python 3.12, cupy-cuda13x 14.2, nvidia-cudnn-cu13, torch 2.11 (cu130),
# onnxruntime (CPU) and no internet. What is missing is installed from wheels carried in
# .whl/ (ignored by git), only where `import` fails there:
#   nvidia-cudnn-frontend==1.32.0   (module cudnn; not in the image)
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
OUT_DIR="${OUT:-./gpu_check_out}"
mkdir -p "$OUT_DIR"
exec > >(tee -a "$OUT_DIR/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
START=$(date +%s)
echo "== gpu_check $(date -u +%FT%TZ) in $PWD"
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
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "${missing[@]}" && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
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
$PY -c "import tr_onnx, cupy, cudnn, onnx; from tr_onnx.backends import cuda_unavailable_reason as r
print('tr_onnx', tr_onnx.__file__, '| cupy', cupy.__version__, '| cudnn frontend',
      cudnn.__version__, '| onnx', onnx.__version__, '| cuda:', r() or 'usable')"

# -- (a) parity tests ------------------------------------------------------------------------
echo "== (a) pytest -m gpu tests/test_cuda_gpu.py"
timeout 250 $PY -m pytest -m gpu tests/test_cuda_gpu.py -q -rA -p no:cacheprovider \
    --junitxml="$OUT_DIR/pytest_gpu.xml"
rc_tests=$?
echo "== (a) rc=$rc_tests after $(( $(date +%s) - START ))s"

# -- (b) benchmark ---------------------------------------------------------------------------
left=$(( 450 - ($(date +%s) - START) ))
[ $left -lt 90 ] && left=90
echo "== (b) gpu_check.py --benchmark (${left}s left)"
timeout $left $PY scripts/gpu_check.py --benchmark --out "$OUT_DIR" \
    --budget-s $(( left - 60 ))
rc_bench=$?
echo "== (b) rc=$rc_bench; total $(( $(date +%s) - START ))s"
cat "$OUT_DIR/results.md" 2>/dev/null
exit $(( rc_tests != 0 || rc_bench != 0 ))
