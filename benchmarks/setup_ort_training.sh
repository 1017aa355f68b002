#!/usr/bin/env bash
# Create benchmarks/.venv-ort: ONNX Runtime training 1.19.2 (the last release) in a venv of its
# own, because its wheel ships an `onnxruntime` module that replaces the normal package's files.
# Idempotent: an existing venv that already imports onnxruntime.training is left as it is.
#
#   bash benchmarks/setup_ort_training.sh [PYTHON]     (default: python3.11 or python3)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$here/.venv-ort"
python="${1:-$(command -v python3.11 || command -v python3)}"

check() {  # the peer's own import path (it keeps torch out of onnxruntime.training)
    "$venv/bin/python" "$here/peer_ort_training.py" --check 2>/dev/null |
        grep -q "onnxruntime 1.19.2"
}

if [ -x "$venv/bin/python" ] && check; then
    echo "ok: $venv already has onnxruntime-training 1.19.2"
    exit 0
fi
"$python" -m venv "$venv"
# numpy<2: the 1.19.2 wheels were built against numpy 1.x. onnx is needed by generate_artifacts;
# protobuf<5 keeps onnx 1.16's generated code working.
"$venv/bin/python" -m pip install --quiet "onnxruntime-training==1.19.2" "numpy<2" \
    "onnx>=1.16,<1.17" "protobuf>=3.20,<5"
check || { echo "setup failed: $venv cannot import onnxruntime.training" >&2; exit 1; }
echo "ok: $venv: $("$venv/bin/python" "$here/peer_ort_training.py" --check)"
