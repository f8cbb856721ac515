#!/usr/bin/env bash
# A/B of the layer step on one GPU (W=1, T=8192, H 4096/8192, E 4/16/64, balanced, serial and
# overlap, 50 timed steps a cell): an older revision's tree (OLD_DIR, default ab_old/) and this
# one, run after run RUNS times, into one table $OUT/layer_host_ab_$NEW.parquet (git_rev tells
# the trees apart, ab_rep the run); then host_profile --idle --launches on H=4096, E 4/64, every
# layer system (IDLE_SYSTEMS=serial,overlap: those only), into $OUT/layer_idle_$NEW.log (the
# device's idle time per step and the kernels it waited before).
# Before: `make wheels-gpu`, `bash benchmarks/h200_session.sh none` (the wheels into /tmp/site),
# and the older tree: on the development machine `git archive $OLD | gzip > ab_old.tgz` (name it
# in .git/info/exclude and carry it with .whl); the script unpacks it into OLD_DIR when that is
# missing (the GPU machine's copy of .git can be stale, so no checkout there).
# Usage: NEW=<this rev> OLD=<older rev> bash benchmarks/layer_ab.sh
set -u
: "${OUT:?}" "${NEW:?}" "${OLD:?}"
old_dir=${OLD_DIR:-ab_old}
if [ ! -d "$old_dir" ]; then
  [ -f ab_old.tgz ] || { echo "layer_ab: no $old_dir/ and no ab_old.tgz (git archive $OLD | gzip > ab_old.tgz)"; exit 1; }
  mkdir -p "$old_dir" && tar -xzf ab_old.tgz -C "$old_dir"
fi
lh=(experiment=layer hardware.world_size=1 'experiment.grid.tokens_per_rank=[8192]' 'experiment.grid.hidden=[4096,8192]' 'experiment.grid.experts_per_rank=[4,16,64]' 'experiment.grid.routing=[balanced]' 'experiment.select=[serial,overlap]' measure.iters=50 progress=false)
parts=$(mktemp -d)
for rep in $(seq "${RUNS:-3}"); do
  (cd "$old_dir" && HARNESS_GIT_REV=$OLD PYTHONPATH=/tmp/site:$PWD timeout 100 python3 -m harness.run "${lh[@]}" table="$parts/old_r$rep.parquet" 2>&1 | tail -1)
  HARNESS_GIT_REV=$NEW PYTHONPATH=/tmp/site:$PWD timeout 100 python3 -m harness.run "${lh[@]}" table="$parts/new_r$rep.parquet" 2>&1 | tail -1
done
ih=(experiment=layer hardware.world_size=1 'experiment.grid.tokens_per_rank=[8192]' 'experiment.grid.hidden=[4096]' 'experiment.grid.experts_per_rank=[4,64]' 'experiment.grid.routing=[balanced]')
[ -n "${IDLE_SYSTEMS:-}" ] && ih+=("experiment.select=[$IDLE_SYSTEMS]")
PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m benchmarks.host_profile --idle --launches --steps 10 -- "${ih[@]}" 2>&1 | grep -v "^ *$\|Warn\|warn" > "$OUT/layer_idle_$NEW.log"
cut -c1-150 "$OUT/layer_idle_$NEW.log"
PYTHONPATH=/tmp/site:$PWD python3 -m benchmarks.ab_table "$parts" "$OUT/layer_host_ab_$NEW.parquet"
PYTHONPATH=/tmp/site:$PWD python3 - <<'PY'
import os
import pandas as pd
d = pd.read_parquet(f"{os.environ['OUT']}/layer_host_ab_{os.environ['NEW']}.parquet")
d = d[d.status == "ok"]
m = d.groupby(["hidden", "experts_per_rank", "system", "git_rev"]).latency_ms.median()
pd.set_option("display.width", 250)
print(f"median of the runs\n{m.unstack(['system', 'git_rev']).round(3).to_string()}")
PY
