"""`python -m harness.run <overrides>` in the test's own process, for tests that check a run's
table rather than its command line: the same composition and launch (ranks are spawned as on
the command line), without a second interpreter that imports torch again. The command line's
own behaviour (exit codes, one-line errors, signals) is tested through subprocesses."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import open_dict

ROOT = Path(__file__).resolve().parents[1]


def compose_run(*overrides: str):
    """The config and the chosen workload group (or None), as harness.run.main gets them."""
    from harness.config import register_configs

    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    workload = cfg.hydra.runtime.choices.get("workload")
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, workload if workload not in (None, "null") else None


def launch(*overrides: str, ranks: bool = True) -> int:
    """harness.run.launch on these overrides: its exit code. ranks=False: starting a rank fails
    the test (a run that must have nothing to do)."""
    import harness.run as hr

    cfg, workload = compose_run(*overrides)
    if ranks:
        return hr.launch(cfg, workload)

    def no_ranks(*a, **k):
        raise AssertionError("ranks started")

    orig, hr.run_ranks = hr.run_ranks, no_ranks
    try:
        return hr.launch(cfg, workload)
    finally:
        hr.run_ranks = orig
