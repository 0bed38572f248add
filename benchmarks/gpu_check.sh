#!/usr/bin/env bash
# The project's GPU validation (benchmarks/gpu_check.py): a float32 exactness matrix against
# `model.generate`, bf16 throughput against transformers' generate_batch with every row's tokens
# checked against `model.generate` on the same GPU, decode step vs the memory-bandwidth floor.
# From the repository root of a machine with a CUDA GPU, torch and Triton (no network needed):
#
#   make gpu-bundle                    # here, with network: .gpu_bundle/ (<= 64 MiB, git-ignored)
#   bash benchmarks/gpu_check.sh       # there, with .gpu_bundle/ carried beside the tree
#
# Without the bundle it stops at once (exit 2), before anything else runs, naming that command.
# Exit status 0 only if every promised row was verified: an exactness row skipped (budget spent,
# or GPU_CHECK_SKIP_ROW=<index>) fails the check, as does a throughput row whose tokens were not
# all produced and compared, and the merge re-checks every row from the results themselves.
#
# Budget, worst case (each step under its own `timeout`; fastest first, slowest last):
#   bundle verify + wheel install   25 s
#   version report                  15 s
#   host_overhead.py                20 s   (informational; CPU kernels off: nothing is built)
#   part exact                     150 s   (gpu_check.py's own budget ends it ~25 s sooner)
#   part throughput                200 s   (idem)
#   merge                           10 s
#   total                          420 s = 7 minutes
# Tensor parallelism (benchmarks/tp.py) is not part of this check: it needs two devices.
#
# Written under $OUT (default out/gpu_check) as it goes, so a timeout keeps what was measured:
# gpu_check.log (everything printed), env.txt, host_overhead.md, gpu_part_exact.json and
# gpu_part_throughput.json (rewritten after every run), gpu_results.{json,md} (the merge).
#
# GPU_CHECK_DRYRUN=1 runs the same script on the CPU (project venv, `--smoke --device cpu`, tiny
# models, the reference attention backend, no bundle, every timeout doubled): the plumbing and
# the pass/fail logic, tested by tests/test_gpu_check.py. Other env: PYTHON, GPU_CHECK_BUNDLE (default
# .gpu_bundle), GPU_CHECK_SKIP_ROW. Arguments are passed to gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
DRYRUN="${GPU_CHECK_DRYRUN:-0}"
BUNDLE="${GPU_CHECK_BUNDLE:-$PWD/.gpu_bundle}"
if [[ "$DRYRUN" != "1" && ! -f "$BUNDLE/manifest.json" ]]; then
  echo "ERROR: no GPU bundle at $BUNDLE; make it first (on a machine with network), then carry it:" >&2
  echo "  make gpu-bundle" >&2
  exit 2
fi
T_INSTALL=25 T_VERSIONS=15 T_HOST=20 T_EXACT=150 T_TP=200 T_MERGE=10
if [[ "$DRYRUN" == "1" ]]; then  # a small shared CPU starts Python slowly: the same steps, twice the time
  T_INSTALL=50 T_VERSIONS=30 T_HOST=40 T_EXACT=300 T_TP=400 T_MERGE=20
  PY="${PYTHON:-$PWD/.venv/bin/python}"
  EXTRA=(--smoke --device cpu)
else
  PY="${PYTHON:-python3}"
  EXTRA=()
fi
OUTDIR="${OUT:-$PWD/out/gpu_check}"
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

main() {
echo "== gpu_check.sh $(date -u +%FT%TZ) on ${HOSTNAME:-?}, dry run: $DRYRUN, args: $*"
{
  echo "== nvidia-smi"; (nvidia-smi 2>&1 || echo "nvidia-smi not available")
  echo "== uname"; uname -a
  echo "== python"; "$PY" --version
} > "$OUTDIR/env.txt" 2>&1
cat "$OUTDIR/env.txt"

if [[ "$DRYRUN" != "1" ]]; then
  timeout "$T_INSTALL" "$PY" benchmarks/gpu_check_bundle.py --verify --out "$BUNDLE" || return 2
  echo "== installing the bundle's wheels into /tmp/site"
  timeout "$T_INSTALL" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site --find-links "$BUNDLE/wheels" -r "$BUNDLE/requirements.txt" || return 2
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  if [[ -d "$BUNDLE/models" ]]; then export CONTBATCH_CACHE="$BUNDLE/models"; fi
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

timeout "$T_VERSIONS" "$PY" - <<'PYEOF' 2>&1 | tee -a "$OUTDIR/env.txt" || echo "== version report FAILED (see above)"
import importlib.metadata as md, sys
for name in ("torch", "triton", "transformers", "tokenizers", "huggingface_hub", "safetensors", "numpy"):
    try:
        print(f"{name} {md.version(name)}")
    except Exception as e:
        print(f"{name} MISSING ({e!r})")
import torch, transformers, contbatch
print("torch.cuda:", torch.version.cuda, "available:", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
print("transformers", transformers.__version__, "from", transformers.__file__)
print("contbatch", contbatch.__version__, "from", contbatch.__file__)
PYEOF

echo "== host_overhead.py (timeout ${T_HOST}s, informational)"
timeout --signal=TERM --kill-after=3 "$T_HOST" "$PY" -u benchmarks/host_overhead.py --batches 64 256 --new-tokens 40 \
  --repeats 1 --cpu-kernels off 2>&1 | tee "$OUTDIR/host_overhead.md" || echo "== host_overhead.py did not finish (informational)"

# Each part in its own process, so a kernel fault (a poisoned CUDA context, a segfault) in the
# exactness matrix cannot cost the timings; results written after every run.
rm -f "$OUTDIR"/gpu_part_*.json "$OUTDIR"/gpu_results.*
rc=0
for part in exact throughput; do
  if [[ $part == exact ]]; then limit="$T_EXACT"; else limit="$T_TP"; fi
  echo "== gpu_check.py --parts $part (timeout ${limit}s), writing to $OUTDIR"
  prc=0
  timeout --signal=TERM --kill-after=10 "$limit" "$PY" -u benchmarks/gpu_check.py --parts "$part" \
    --out-dir "$OUTDIR" "${EXTRA[@]}" "$@" || prc=$?
  case "$prc" in
    0) echo "== part $part: passed" ;;
    124) echo "== part $part: TIMED OUT after ${limit}s; partial results kept" ;;
    *) echo "== part $part: exit status $prc (a check failed, a row was not verified, or a run crashed)" ;;
  esac
  if (( rc == 0 )); then rc=$prc; fi
done
mrc=0
timeout "$T_MERGE" "$PY" -u benchmarks/gpu_check.py --merge --out-dir "$OUTDIR" || mrc=$?
if (( rc == 0 )); then rc=$mrc; fi
echo "== gpu_check.sh: exit status $rc ($( (( rc == 0 )) && echo 'every promised row verified' || echo 'see FAIL/ERROR/SKIPPED/TIMED OUT above'))"
ls -la "$OUTDIR"
return "$rc"
}

: > "$OUTDIR/gpu_check.log"
main "$@" 2>&1 | tee -a "$OUTDIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
