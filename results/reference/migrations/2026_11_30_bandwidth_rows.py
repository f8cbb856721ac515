"""One-off migration (2026-11-30): Fig 3a's table from the old benchmark script to Row tables.

benchmarks/bandwidth.py became the `bandwidth` harness experiment (experiments/bandwidth.py),
whose rows follow harness.records.Row. This rewrites results/reference/h200/bandwidth.parquet
(measured by the old script at rev 57f4076 on one H200) into that schema:
  transport, ccta       -> transport, p_transport, p_ccta (system `overlap`)
  bytes, n_segments, total_bytes, gbps -> m_segment_bytes, m_n_segments, m_bytes_sent, m_gbps
  ms                    -> latency_ms (the old script timed with triton's do_bench, the
                           experiment with CUDA events per iteration: same launch, other timer)
  gpu                   -> gpu_name; world_size 4 for loopback (rank 0 sent to 3 regions), 1 for
                           the old NVSHMEM self-put rows (nvshmem/store, nvshmem/put_signal: PE 0
                           to itself, a local copy too); skipped rows keep their reason.
Run once from the repository root.
"""

import hashlib
import json
from pathlib import Path

import pandas as pd

from harness.records import Row, row_dict

PATH = Path("results/reference/h200/bandwidth.parquet")


def main() -> None:
    old = pd.read_parquet(PATH)
    if "cell_hash" in old:
        print(f"{PATH}: already migrated")
        return
    rows = []
    for r in old.to_dict("records"):
        ok = r["status"] == "ok"
        tr = str(r["transport"])
        params = {"transport": tr} if r["ccta"] != r["ccta"] else {"ccta": int(r["ccta"]), "transport": tr}
        metrics = {}
        if ok:
            metrics = {
                "segment_bytes": float(r["bytes"]),
                "n_segments": float(r["n_segments"]),
                "bytes_sent": float(r["total_bytes"]),
                "gbps": float(r["gbps"]),
            }
        blob = json.dumps({k: str(v) for k, v in r.items()}, sort_keys=True)
        rows.append(
            Row(
                experiment="bandwidth",
                system="overlap",
                impl="consumer kernel (triton); benchmarks/bandwidth.py, rev 57f4076",
                scope="combine",
                cell_hash=hashlib.sha1(blob.encode()).hexdigest()[:16],
                world_size=4 if tr == "loopback" else (1 if tr.startswith("nvshmem/") else 2),
                transport=tr,
                out=4096,
                dtype="bfloat16",
                latency_ms=float(r["ms"]) if ok else float("nan"),
                max_rel_err=0.0 if ok else float("nan"),
                status=r["status"],
                reason=str(r["reason"] or ""),
                params=params,
                metrics=metrics,
                gpu_name=str(r["gpu"]),
                gpu_count=1,
                git_rev="57f4076",
                command="python benchmarks/bandwidth.py --out $OUT",
            )
        )
    pd.DataFrame([row_dict(x) for x in rows]).to_parquet(PATH, index=False)
    print(f"{PATH}: {len(rows)} rows migrated")


if __name__ == "__main__":
    main()
