"""Cell expansion: the grid holds the workload axes, each system its own params and sweep."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from harness.config import register_configs
from harness.measure import expand_grid, system_points
from harness.records import Row, row_dict

ROOT = Path(__file__).resolve().parents[1]


def _compose(*overrides):
    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_a_system_without_a_sweep_runs_once_per_workload():
    cfg = _compose("experiment=overlap_sweep")
    cells = expand_grid(cfg, 2)
    workloads = 1 * 1 * 1 * 5 * 1 * 3 * 1  # tokens, K, N, E (table2), top_k, routings, dtype
    serial = [c for c in cells if c["system"] == "serial"]
    overlap = [c for c in cells if c["system"] == "overlap"]
    assert len(serial) == workloads
    assert len(overlap) == workloads * 7 * 2  # its own cCTA x mgb sweep
    assert all(c["params"] == {} for c in serial)
    assert {(c["params"]["ccta"], c["params"]["mgb"]) for c in overlap} == {
        (c, m) for c in (2, 4, 8, 14, 16, 20, 24) for m in (1, 2)
    }
    assert all(c["params"]["transport"] == "p2p" for c in overlap)
    assert len({c["cell_hash"] for c in cells}) == len(cells)


def test_params_fill_defaults_and_the_hash_covers_them():
    (point,) = system_points("overlap", {"params": {"ccta": 8}})
    assert point == {
        **{"ccta": 8, "mgb": 1, "tile_m": 128, "transport": ""},
        **{"local": "direct", "layout": "aligned", "order": "auto", "swizzle": "table"},
        "consumer": "own",
        "backoff_ns": 0,
        "handshake": "allreduce",
        "handshake_stream": "step",
    }
    cfg = _compose("experiment=smoke", "+experiment.systems.overlap.params.ccta=8")
    cfg2 = _compose("experiment=smoke", "+experiment.systems.overlap.params.ccta=4")
    h1 = {c["cell_hash"] for c in expand_grid(cfg, 4) if c["system"] == "overlap"}
    h2 = {c["cell_hash"] for c in expand_grid(cfg2, 4) if c["system"] == "overlap"}
    assert h1 and not h1 & h2
    serial1 = {c["cell_hash"] for c in expand_grid(cfg, 4) if c["system"] == "serial"}
    serial2 = {c["cell_hash"] for c in expand_grid(cfg2, 4) if c["system"] == "serial"}
    assert serial1 == serial2  # another system's knob leaves serial's cells alone


@pytest.mark.parametrize(
    "conf, message",
    [
        ({"params": {"cta": 8}}, "has no parameter 'cta'; it accepts: backoff_ns, ccta,"),
        ({"sweep": {"mgbb": [1]}}, "has no parameter 'mgbb'"),
        ({"params": {"ccta": 8}, "sweep": {"ccta": [2, 4]}}, "both fixed (params) and swept"),
        ({"sweep": {"ccta": []}}, "sweep.ccta is empty"),
        ({"sweep": {"ccta": 4}}, "sweep.ccta must be a list"),
        ({"sweep": {"ccta": [8, 2, 8]}}, "sweep.ccta lists 8 twice"),
        ({"parms": {"ccta": 4}}, "keys params and/or sweep"),
    ],
)
def test_bad_system_params_name_the_system(conf, message):
    with pytest.raises(ValueError) as exc:
        system_points("overlap", OmegaConf.create(conf))
    assert message in str(exc.value)


def test_select_narrows_the_systems():
    cfg = _compose("experiment=operator", "experiment.select=[overlap]")
    assert {c["system"] for c in expand_grid(cfg, 2)} == {"overlap"}
    cfg = _compose("experiment=operator", "experiment.select=[nope]")
    with pytest.raises(ValueError, match="experiment.select names"):
        expand_grid(cfg, 2)


def test_rows_write_params_as_p_columns():
    row = Row("x", "tutel", params={"degrees": [1, 2], "degree": 0, "scope": "layer"})
    d = row_dict(row)
    assert d["p_degrees"] == "[1, 2]" and d["p_degree"] == 0 and d["p_scope"] == "layer"
    assert "params" not in d and "ccta" not in d


def test_a_hash_optional_param_stays_out_of_the_hash_only_at_its_old_value():
    # overlap's `local` came after tables were measured with "copy"; its default is "direct"
    from harness.measure import hashed_params

    (default,) = system_points("overlap", {"params": {"transport": "p2p"}})
    assert default["local"] == "direct" and hashed_params("overlap", default)["local"] == "direct"
    pts = system_points("overlap", {"sweep": {"local": ["copy", "direct"]}})
    assert [p["local"] for p in pts] == ["copy", "direct"]
    assert "local" not in hashed_params("overlap", pts[0])
    cfg = _compose("experiment=operator", "+experiment.systems.overlap.sweep.local=[copy,direct]")
    cells = [c for c in expand_grid(cfg, 2) if c["system"] == "overlap"]
    by_local = {c["params"]["local"]: c["cell_hash"] for c in cells[:2]}
    assert len(set(by_local.values())) == 2  # copy and direct are different cells


def test_the_committed_layer_table_still_resumes():
    # the overlap p2p rows of the reference layer table measured before the `local` knob (no
    # p_local: they ran copy) are cells of today's layer grid with local=copy (same hash), the
    # rows at local=direct cells of the grid at order=remote_first (the order before the
    # `order` knob), so a resumed run measures neither again; the default order ("auto") is a
    # new cell
    import pandas as pd

    ref = ROOT / "results/reference/h200x2/layer.parquet"
    df = pd.read_parquet(ref, columns=["system", "transport", "cell_hash", "p_local"])
    p2p = df[(df["system"] == "overlap") & (df["transport"] == "p2p")]
    old = set(p2p[p2p["p_local"].isna()]["cell_hash"])
    new = set(p2p[p2p["p_local"] == "direct"]["cell_hash"])
    copy = _compose(
        "experiment=layer",
        "+experiment.systems.overlap.params.local=copy",
        "+experiment.systems.overlap.params.order=remote_first",
    )
    assert old and old <= {c["cell_hash"] for c in expand_grid(copy, 2)}
    first = _compose("experiment=layer", "+experiment.systems.overlap.params.order=remote_first")
    direct = {c["cell_hash"] for c in expand_grid(first, 2)}
    assert new and new <= direct and not old & direct
    auto = {c["cell_hash"] for c in expand_grid(_compose("experiment=layer"), 2)}
    assert not (old | new) & auto
