#!/usr/bin/env bash
# GPU check of the inference worker's vLLM engine: installs the vllm extra if it is missing, runs the
# gpu tests (tests/gpu) and prints tables of their outcome, the measured throughput, and the
# cut-and-continue runs (a generation cut through the worker, continued from its staged prefix).
# Budget: under 10 minutes on one GPU (install <= 4 min, tests <= 5 min).
#
#   scripts/gpu_check.sh                    # uses .venv/bin/python if present, else python3
#   PYTHON=/path/python NG_VLLM_ARGS='{"attention_backend": "FLEX_ATTENTION"}' scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${NG_GPU_CHECK_OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export NG_GPU_REPORT="$OUT/throughput.json" NG_GPU_CUTS_REPORT="$OUT/cuts.json" HF_HUB_OFFLINE=1

if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    if ! "$PY" -c "import vllm" 2>/dev/null; then
        echo "gpu_check: installing the vllm extra (at most 4 minutes)"
        timeout 240 "$PY" -m pip install -q -e ".[vllm,dev]"
    fi
else
    echo "gpu_check: no NVIDIA GPU here; nothing installed, the gpu tests will skip" >&2
fi

set +e
timeout 300 "$PY" -m pytest tests/gpu -m gpu -p no:cacheprovider -q -rA --timeout 280 \
    --junitxml "$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.log"
status=${PIPESTATUS[0]}
set -e

"$PY" - "$OUT/gpu-tests.xml" "$NG_GPU_REPORT" "$NG_GPU_CUTS_REPORT" <<'PYEOF'
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

junit, report, cuts = map(Path, sys.argv[1:4])
print("\n| gpu test | outcome | seconds |\n|---|---|---|")
if junit.is_file():
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        print(f"| {case.get('name')} | {outcome} | {float(case.get('time', 0)):.1f} |")
if report.is_file():
    data = json.loads(report.read_text())
    print(f"\n{data['engine']}, prompt {data['prompt_tokens']} tokens, context {data['context_length']}")
    print("| batch | new tokens | seconds | tokens/s |\n|---|---|---|---|")
    for row in data["results"]:
        print(f"| {row['batch_size']} | {row['new_tokens']} | {row['seconds']} | {row['tokens_per_s']} |")
else:
    print("\n(no throughput numbers: the throughput test did not run)")
if cuts.is_file():
    print("\ncut and continue (vLLM, through the worker; sampled continuations are fresh samples after the prefix)")
    print("| temperature | prefix tokens | total tokens | prefix kept | tokens equal uncut | max abs logprob diff "
          "| continued ms |\n|---|---|---|---|---|---|---|")
    for row in json.loads(cuts.read_text()):
        print(f"| {row['temperature']} | {row['prefix_tokens']} | {row['total_tokens']} | {row['prefix_kept']} "
              f"| {row['tokens_equal_uncut']} | {row['max_abs_logprob_diff']:.2e} | {row['continued_ms']} |")
else:
    print("\n(no cut-and-continue numbers: that test did not run)")
PYEOF
exit "$status"
