#!/usr/bin/env bash
# A/B of the operator step on one GPU (W=1, T=8192, N 4096/8192, E 4-64, three routings; the
# systems in AB_SELECT, default serial): an older revision's tree (OLD_DIR, default ab_old/) and
# this one, run after run RUNS times (default 2), into one table $OUT/operator_ab_$NEW.parquet
# (git_rev tells the trees apart, ab_rep the run), then a per-cell table of the medians
# (old ms, new ms, old - new, new / old).
# Before: `make wheels-gpu`, `bash benchmarks/h200_session.sh none` (the wheels into /tmp/site),
# and the older tree: on the development machine `git archive $OLD | gzip > ab_old.tgz` (named in
# .git/info/exclude; carry it with .whl); unpacked into OLD_DIR when that is missing.
# Usage: NEW=<this rev> OLD=<older rev> bash benchmarks/operator_ab.sh
set -u
: "${OUT:?}" "${NEW:?}" "${OLD:?}"
old_dir=${OLD_DIR:-ab_old}
if [ ! -d "$old_dir" ]; then
  [ -f ab_old.tgz ] || { echo "operator_ab: no $old_dir/ and no ab_old.tgz (git archive $OLD | gzip > ab_old.tgz)"; exit 1; }
  mkdir -p "$old_dir" && tar -xzf ab_old.tgz -C "$old_dir"
fi
op=(experiment=operator hardware=h200 hardware.world_size=1 'experiment.grid.tokens_per_rank=[8192]' "experiment.select=[${AB_SELECT:-serial}]" "measure.iters=${AB_ITERS:-20}" progress=false)
parts=$(mktemp -d)
for rep in $(seq "${RUNS:-2}"); do
  (cd "$old_dir" && HARNESS_GIT_REV=$OLD PYTHONPATH=/tmp/site:$PWD timeout "${AB_S:-120}" python3 -m harness.run "${op[@]}" table="$parts/old_r$rep.parquet" 2>&1 | tail -1)
  HARNESS_GIT_REV=$NEW PYTHONPATH=/tmp/site:$PWD timeout "${AB_S:-120}" python3 -m harness.run "${op[@]}" table="$parts/new_r$rep.parquet" 2>&1 | tail -1
done
PYTHONPATH=/tmp/site:$PWD python3 -m benchmarks.ab_table "$parts" "$OUT/operator_ab_$NEW.parquet"
PYTHONPATH=/tmp/site:$PWD python3 - <<'PY'
import os
import pandas as pd
out, new, old = (os.environ[k] for k in ("OUT", "NEW", "OLD"))
d = pd.read_parquet(f"{out}/operator_ab_{new}.parquet")
ok = d[d.status == "ok"]
p = ok.pivot_table(index=["system", "out", "experts_per_rank", "routing"], columns="git_rev",
                   values="latency_ms", aggfunc="median")
p["old-new"] = p[old] - p[new]
p["new/old"] = p[new] / p[old]
pd.set_option("display.width", 200)
print(p.round(4).to_string())
print(p.groupby(level="system")[["old-new", "new/old"]].describe().round(4).T.to_string())
PY
