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
    assert all(c["params"] == {"dispatch": "auto"} for c in serial)
    assert {(c["params"]["ccta"], c["params"]["mgb"]) for c in overlap} == {
        (c, m) for c in (2, 4, 8, 14, 16, 20, 24) for m in (1, 2)
    }
    assert all(c["params"]["transport"] == "p2p" for c in overlap)
    assert len({c["cell_hash"] for c in cells}) == len(cells)


def test_params_fill_defaults_and_the_hash_covers_them():
    (point,) = system_points("overlap", {"params": {"ccta": 8}})
    assert point == {
        **{"ccta": 8, "mgb": 1, "tile_m": 128, "transport": ""},
        **{"layout": "aligned", "order": "auto", "consumer": "own", "dispatch": "auto"},
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
        ({"params": {"cta": 8}}, "has no parameter 'cta'; it accepts: ccta, consumer,"),
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


def test_the_committed_layer_table_resumes(monkeypatch):
    # its rows were timed eagerly, with the NCCL dispatch and (overlap) the remote-first order,
    # the only order then: each row has the hash of that cell today where the machine is not
    # known (a CPU, as here: the hash takes the preset's name, as it did when they were hashed);
    # on the two H200s themselves the machine (h200x2) enters the hash, and they are new cells
    import pandas as pd

    from harness import records

    monkeypatch.setattr(records, "this_machine", lambda: "cpu")  # also where CUDA is
    ref = ROOT / "results/reference/h200x2/layer.parquet"
    df = pd.read_parquet(ref, columns=["system", "cell_hash"])
    ran = (
        "measure.graph=false",
        "+experiment.systems.overlap.params.dispatch=nccl",
        "+experiment.systems.serial.params.dispatch=nccl",
    )
    first = _compose(
        "experiment=layer", "+experiment.systems.overlap.params.order=remote_first", *ran
    )
    overlap = set(df[df["system"] == "overlap"]["cell_hash"])
    assert overlap and overlap <= {c["cell_hash"] for c in expand_grid(first, 2)}
    auto = {c["cell_hash"] for c in expand_grid(_compose("experiment=layer", *ran), 2)}
    assert not overlap & auto  # the default order ("auto") is a new cell
    assert set(df[df["system"] != "overlap"]["cell_hash"]) <= auto  # every baseline row resumes
    graphed = {c["cell_hash"] for c in expand_grid(_compose("experiment=layer"), 2)}
    assert not set(df["cell_hash"]) & graphed  # graph timing (the default) is another cell
    monkeypatch.setattr(records, "this_machine", lambda: "h200x2")
    assert not set(df["cell_hash"]) & {c["cell_hash"] for c in expand_grid(first, 2)}
