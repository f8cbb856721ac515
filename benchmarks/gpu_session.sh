#!/usr/bin/env bash
# One device call on a lent GPU host: install the carried wheels, run the named steps, each bounded
# in time; steps, tables and the offline install: docs/experiments.md, "The GPU session script".
# Usage (through the device tool, carrying .whl): HARNESS_GIT_REV=<rev> bash benchmarks/gpu_session.sh STEP...
# Environment: OUT (tables and logs), WHEELS, SITE, PY (the interpreter), STEP_S (a step's seconds),
# ARGS (Hydra overrides, quotes allowed); DRY_RUN=1 prints each command instead
# (tests/test_gpu_session.py reads them).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-results/gpu_session}; mkdir -p "$OUT"
WHEELS=${WHEELS:-.whl}
PY=${PY:-python3}
run() { if [ -n "${DRY_RUN:-}" ]; then echo "+ $*"; else "$@"; fi; }
# the device's copy of the tree may carry a stale .git: rows take the revision named here
[ -n "${HARNESS_GIT_REV:-}" ] || echo "warning: HARNESS_GIT_REV is not set; rows take this copy's git HEAD"
ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "no wheels in $WHEELS/: run make wheels-gpu where there is network, then carry $WHEELS"; exit 1; }
SITE=${SITE:-/tmp/site}  # where they install (the image's own packages stay as they are)
run "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl || exit 1
export PYTHONPATH=$SITE:$PWD
# this host's machine (its reference folder), from the GPU model and count torch finds
MACHINE=$("$PY" -c "from harness.records import this_machine; print(this_machine())") || exit 1
if [ "$MACHINE" = cpu ] && [ -z "${DRY_RUN:-}" ]; then echo "no CUDA GPU here"; exit 1; fi
echo "machine $MACHINE: tables for results/reference/$MACHINE/"
eval "extra=(${ARGS:-})"
tests() {  # tests <timeout> <pytest args...>
  run timeout "$1" "$PY" -m pytest -q -m gpu -x -p no:cacheprovider "${@:2}" 2>&1 | tee -a "$OUT/pytest_gpu.log" | tail -12
}
experiment() {  # experiment <name>: run it into this session's table $OUT/<name>.parquet
  local table="$OUT/$1.parquet"
  run timeout "${STEP_S:-520}" "$PY" -m harness.run "experiment=$1" hardware=h200 progress=false table="$table" "${extra[@]}" 2>&1 | tee "$OUT/$1.log" | tail -8
  run "$PY" -m benchmarks.table_summary "$table" | tail -40
  echo "$table holds this session's rows only: it replaces results/reference/$MACHINE/$1.parquet whole"
}
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    tests_a) tests "${STEP_S:-520}" --ignore=tests/test_overlap_system_gpu.py --ignore=tests/test_multigpu_gpu.py ;;
    tests_b) tests "${STEP_S:-300}" tests/test_overlap_system_gpu.py ;;
    tests_multigpu) tests "${STEP_S:-300}" --durations=0 tests/test_multigpu_gpu.py ;;
    *) if [ ! -f "conf/experiment/$step.yaml" ]; then
         echo "unknown step $step: tests_a, tests_b, tests_multigpu or one of: $(ls conf/experiment | sed 's/\.yaml$//' | tr '\n' ' ')"; exit 2; fi
       experiment "$step"
       if [ "$step" = ccta_auto ]; then  # this GPU model's committed sweeps, then this session's
         model=${MACHINE%x[0-9]*}
         sms=$("$PY" -c "import torch; print(torch.cuda.get_device_properties(0).multi_processor_count)" 2>/dev/null || echo 132)
         refs=$(ls "results/reference/$model/overlap_ccta.parquet" results/reference/"$model"x*/ccta_mgb.parquet 2>/dev/null)
         # shellcheck disable=SC2086 # refs: one path a word
         run "$PY" -m systems.overlap.autotune_fit $refs "$OUT/ccta_auto.parquet" --sm-count "$sms" --table "$OUT/autotune_table.csv" --heldout "$OUT/autotune_heldout.parquet" 2>&1 | tail -4
       fi ;;
  esac
done
echo "=== done $(date +%T)"
