#!/usr/bin/env bash
# The project's GPU validation script (benchmarks/gpu_check.py): exactness matrix, bf16 throughput
# against transformers' generate_batch, decode step vs the memory-bandwidth floor. One run,
# < 8 minutes, from the repository root of a machine with a CUDA GPU:
#
#   bash benchmarks/gpu_check.sh
#
# The machine needs torch with CUDA and triton; the pinned transformers 5.24.0 and tokenizers
# 0.23.3 are installed for the run from wheels in .whl/ (git-ignored, ~17 MiB; SKIP_WHEELS=1
# uses what is installed instead). No network access and no model download are needed: the
# models are random-weight (benchmarks/gpu_check_models.py).
#
# Worst case ~505 s (the two parts' timeouts, 190 + 255 s, 35 s of host-overhead
# measurement, ~25 s of wheel install and version checks); typically less. What it writes under
# $OUT (7 files; host_overhead.md is the engine's CPU time per step on that machine's host):
# gpu_check.log (everything printed), env.txt (nvidia-smi, versions), gpu_results.md (the tables,
# for benchmarks/RESULTS.md), gpu_results.json (raw, merged) and gpu_part_exact.json /
# gpu_part_throughput.json (each part's raw results, written as it goes: kept on a timeout).
# Exit status 0 only if every check passed and both parts finished.
#
# Populate .whl first, on any machine with access to PyPI:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl transformers==5.24.0 tokenizers==0.23.3
#
# Smoke test anywhere (no wheels installed, project venv, tiny sizes on the CPU):
#
#   PYTHON=.venv/bin/python SKIP_WHEELS=1 bash benchmarks/gpu_check.sh --smoke --device cpu
#
# Arguments are passed to gpu_check.py. Env: PYTHON (default python3), SKIP_WHEELS=1,
# GPU_CHECK_EXACT_TIMEOUT / GPU_CHECK_TP_TIMEOUT (seconds per part, default 190 / 255; the
# python's own budgets end each part ~20 s sooner), OUT (output folder; default out/gpu_check).
# Smoke runs want smaller limits, e.g. GPU_CHECK_EXACT_TIMEOUT=150 GPU_CHECK_TP_TIMEOUT=110.
# GPU_CHECK_PARTS="throughput" reruns one part alone (the merge then reports the other missing).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUTDIR="${OUT:-$PWD/out/gpu_check}"
LIMIT_EXACT="${GPU_CHECK_EXACT_TIMEOUT:-190}"
LIMIT_TP="${GPU_CHECK_TP_TIMEOUT:-255}"
PARTS="${GPU_CHECK_PARTS:-exact throughput}"
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

main() {
echo "== gpu_check.sh $(date -u +%FT%TZ) on ${HOSTNAME:-?}, args: $*"
{
  echo "== nvidia-smi"; (nvidia-smi 2>&1 || echo "nvidia-smi not available")
  echo "== uname"; uname -a
  echo "== python"; "$PY" --version
} | tee "$OUTDIR/env.txt"

if [[ "${SKIP_WHEELS:-0}" != "1" ]]; then
  shopt -s nullglob
  wheels=(.whl/*.whl)
  if (( ${#wheels[@]} == 0 )); then
    echo "ERROR: no wheels in .whl/ (see the header of this script for how to fill it, or SKIP_WHEELS=1)"; exit 2
  fi
  echo "== installing ${#wheels[@]} wheels into /tmp/site: ${wheels[*]}"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}"
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

"$PY" - <<'EOF' 2>&1 | tee -a "$OUTDIR/env.txt" || echo "== version check FAILED (see above); running the parts anyway"
import importlib.metadata as md, importlib.util, sys
for name in ("torch", "triton", "transformers", "tokenizers", "huggingface_hub", "safetensors", "numpy", "regex", "tqdm", "psutil"):
    try:
        print(f"{name} {md.version(name)}")
    except Exception as e:
        print(f"{name} MISSING ({e!r})")
import torch, transformers
print("torch.cuda:", torch.version.cuda, "available:", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
print("transformers imported from", transformers.__file__, transformers.__version__)
print("flash_attn importable:", importlib.util.find_spec("flash_attn") is not None)
import contbatch
print("contbatch", contbatch.__version__, "from", contbatch.__file__,
      "| server modules imported by `import contbatch`:",
      sorted(m for m in sys.modules if m.startswith("contbatch.server")) or "none",
      "| fastapi imported:", "fastapi" in sys.modules)
EOF

# Each part in its own process, so a kernel fault (a poisoned CUDA context, a segfault) in the
# exactness matrix cannot cost the timings; each under its own timeout, results written as it goes.
rm -f "$OUTDIR"/gpu_part_*.json "$OUTDIR"/gpu_results.*
rc=0
for part in $PARTS; do
  if [[ $part == exact ]]; then limit="$LIMIT_EXACT"; else limit="$LIMIT_TP"; fi
  echo "== gpu_check.py --parts $part (timeout ${limit}s), writing to $OUTDIR"
  prc=0
  timeout --signal=TERM --kill-after=15 "$limit" "$PY" -u benchmarks/gpu_check.py --parts "$part" --out-dir "$OUTDIR" "$@" || prc=$?
  case "$prc" in
    0) echo "== part $part: passed" ;;
    124) echo "== part $part: TIMED OUT after ${limit}s; partial results kept" ;;
    *) echo "== part $part: exit status $prc (1: a check failed or a run crashed; see above)" ;;
  esac
  if (( rc == 0 )); then rc=$prc; fi
done
# The engine's host work per step on this machine's CPU (what async batching must hide behind
# each device step); informational, never fails the check.
echo "== host_overhead.py (timeout 35s)"
timeout --signal=TERM --kill-after=5 35 "$PY" -u benchmarks/host_overhead.py --batches 64 256 --new-tokens 40 \
  --repeats 1 2>&1 | tee "$OUTDIR/host_overhead.md" || echo "== host_overhead.py did not finish (informational)"
# Tensor parallelism needs two devices or more; informational (greedy tokens TP=2 vs TP=1 and
# throughput in tp.md), never fails the check, and skipped on a one-device machine.
ndev=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if (( ndev > 1 )); then
  echo "== tp.py --device cuda (timeout 150s, $ndev devices)"
  timeout --signal=TERM --kill-after=10 150 "$PY" -u benchmarks/tp.py --device cuda --rounds 1 --repeats 2 \
    --out "$OUTDIR/tp.json" 2>&1 | tee "$OUTDIR/tp.md" || echo "== tp.py did not finish (informational)"
else
  echo "== tensor parallelism: skipped ($ndev CUDA device; TP needs 2 or more)"
fi
mrc=0
"$PY" -u benchmarks/gpu_check.py --merge --out-dir "$OUTDIR" || mrc=$?
if (( rc == 0 )); then rc=$mrc; fi
echo "== gpu_check.sh: exit status $rc ($( (( rc == 0 )) && echo 'all checks passed' || echo 'see FAIL/ERROR/TIMED OUT above'))"
ls -la "$OUTDIR"
return "$rc"
}

: > "$OUTDIR/gpu_check.log"
main "$@" 2>&1 | tee -a "$OUTDIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
