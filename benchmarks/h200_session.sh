#!/usr/bin/env bash
# One device call on a lent H200 host: install the carried wheels, run the named steps, each
# bounded in time so the call ends inside its limit; tables and logs land in $OUT.
# Usage (through the device tool, carrying .whl): HARNESS_GIT_REV=<rev> bash benchmarks/h200_session.sh STEP...
# Steps: tests_a, tests_b (the GPU test tier in two calls, each under 10 minutes on one H200), or
# the name of any experiment (conf/experiment/<name>.yaml): harness.run on this host's GPUs,
# resumed from results/reference/<machine>/<name>.parquet, then a short summary of the table.
# ARGS adds Hydra overrides (quotes allowed); STEP_S bounds one step (seconds). ccta_auto also
# refits the calibration table into $OUT (systems/overlap/autotune_fit.py). A new study is a
# YAML under conf/experiment/, not a new step here.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-results/h200_session}; mkdir -p "$OUT"
# the device's copy of the tree may carry a stale .git: rows take the revision named here
[ -n "${HARNESS_GIT_REV:-}" ] || echo "warning: HARNESS_GIT_REV is not set; rows take this copy's git HEAD"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
# this host's reference folder: h200 for one GPU, h200x<n> for n GPUs (MACHINE overrides it)
n_gpu=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
MACHINE=${MACHINE:-$([ "${n_gpu:-0}" -gt 1 ] && echo "h200x$n_gpu" || echo h200)}
eval "extra=(${ARGS:-})"
tests() {  # tests <timeout> <pytest args...>
  timeout "$1" python3 -m pytest -q -m gpu -x -p no:cacheprovider "${@:2}" 2>&1 | tee -a "$OUT/pytest_gpu.log" | tail -12
}
experiment() {  # experiment <name>: run it into $OUT/<name>.parquet, resumed from the reference
  local table="$OUT/$1.parquet" ref="results/reference/$MACHINE/$1.parquet"
  [ -f "$table" ] || [ ! -f "$ref" ] || { cp "$ref" "$table" && chmod u+w "$table"; }
  timeout "${STEP_S:-520}" python3 -m harness.run "experiment=$1" hardware=h200 progress=false table="$table" "${extra[@]}" 2>&1 | tee "$OUT/$1.log" | tail -8
  python3 -m benchmarks.table_summary "$table" | tail -40
}
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    tests_a) tests "${STEP_S:-520}" --ignore=tests/test_overlap_system_gpu.py ;;
    tests_b) tests "${STEP_S:-300}" tests/test_overlap_system_gpu.py ;;
    *) if [ ! -f "conf/experiment/$step.yaml" ]; then
         echo "unknown step $step: tests_a, tests_b or one of: $(ls conf/experiment | sed 's/\.yaml$//' | tr '\n' ' ')"; exit 2; fi
       experiment "$step"
       if [ "$step" = ccta_auto ]; then
         python3 -m systems.overlap.autotune_fit "results/reference/h200/overlap_ccta.parquet" "results/reference/h200x2/ccta_mgb.parquet" "$OUT/ccta_auto.parquet" --table "$OUT/autotune_table.csv" --heldout "$OUT/autotune_heldout.parquet" 2>&1 | tail -4
       fi ;;
  esac
done
echo "=== done $(date +%T)"
