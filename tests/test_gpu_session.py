"""The GPU session script and `make setup` on a machine with no network (issue 56, item 3), read
on the CPU: the carried wheels install with no index and no dependency resolution; a session
runs every experiment into a fresh table of its own (resumed from nothing committed), which
replaces the committed one whole; its machine comes from the GPUs found, not a fixed name."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from harness.records import this_machine

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks/gpu_session.sh"
#: pip with no configured index, find-links or mirror: only what a command names is reachable
NO_INDEX = {
    "PIP_CONFIG_FILE": os.devnull,
    "PIP_FIND_LINKS": "",
    "PIP_EXTRA_INDEX_URL": "",
    "PIP_INDEX_URL": "http://127.0.0.1:9/simple",  # nothing listens on the discard port
}


def _wheel(folder: Path, name: str = "carried_probe") -> Path:
    """A minimal pure-Python wheel (one module) in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-0.1-py3-none-any.whl"
    files = {
        f"{name}.py": "VALUE = 1\n",
        f"{name}-0.1.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
        f"{name}-0.1.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for f, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{f},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{name}-0.1.dist-info/RECORD,,")
    with zipfile.ZipFile(path, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
        z.writestr(f"{name}-0.1.dist-info/RECORD", "\n".join(record) + "\n")
    return path


def _session(tmp_path: Path, *steps: str, dry: bool = True, **env: str):
    wheels = tmp_path / "wheels"
    if not wheels.exists():
        _wheel(wheels)
    full = {
        **os.environ,
        **NO_INDEX,
        "OUT": str(tmp_path / "out"),
        "WHEELS": str(wheels),
        "SITE": str(tmp_path / "site"),
        "PY": sys.executable,
        "HARNESS_GIT_REV": "test",
        **({"DRY_RUN": "1"} if dry else {}),
        **env,
    }
    return subprocess.run(
        ["bash", str(SCRIPT), *steps],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=full,
    )


def _commands(text: str) -> list[str]:
    return [line[2:] for line in text.splitlines() if line.startswith("+ ")]


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    """One dry run of a session (its folder, exit code, output): an experiment with ARGS, the
    two test steps of the 2+ GPU split, then a step that does not exist (exit 2)."""
    tmp = tmp_path_factory.mktemp("session")
    steps = ("operator", "tests_a", "tests_multigpu", "no_such_step")
    proc = _session(tmp, *steps, ARGS="'experiment.grid.hidden=[768]'")
    return tmp, proc.returncode, proc.stdout + proc.stderr


def test_a_session_installs_only_the_carried_wheels(dry):
    tmp, _, text = dry
    (pip,) = [c for c in _commands(text) if " -m pip " in c]
    wheels = tmp / "wheels"
    assert f"pip install -q --no-index --find-links {wheels} --no-deps" in pip
    assert f"--target {tmp / 'site'} {wheels}/carried_probe-0.1-py3-none-any.whl" in pip


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path: the script stops there")
def test_the_carried_wheels_install_with_no_index_then_a_cpu_host_stops(tmp_path):
    """The install for real (no index reachable), then no GPU here: the session stops."""
    proc = _session(tmp_path, "operator", dry=False)
    assert (tmp_path / "site/carried_probe.py").exists(), proc.stdout + proc.stderr
    assert proc.returncode == 1 and "no CUDA GPU here" in proc.stdout
    assert not (tmp_path / "out/operator.parquet").exists()


def test_a_session_without_wheels_says_how_to_get_them(tmp_path):
    (tmp_path / "wheels").mkdir()
    proc = _session(tmp_path, "operator")
    assert proc.returncode == 1 and "make wheels-gpu" in proc.stdout


def test_an_experiment_runs_into_a_fresh_table_of_its_own(dry):
    """No committed table is copied in (rows of older hashes would pile up beside the new);
    the harness resumes from the session's own table; the machine comes from the GPUs found
    (here: none, so cpu) and names the committed table it replaces whole."""
    tmp, _, text = dry
    table = tmp / "out/operator.parquet"
    runs = [c for c in _commands(text) if "-m harness.run" in c]
    assert runs == [
        f"timeout 520 {sys.executable} -m harness.run experiment=operator hardware=h200 "
        f"progress=false table={table} experiment.grid.hidden=[768]"
    ]
    machine = this_machine()  # cpu in the CPU tier
    assert f"machine {machine}" in text
    assert f"replaces results/reference/{machine}/operator.parquet whole" in text
    assert not any(c.startswith("cp ") for c in _commands(text)) and not table.exists()
    if machine == "cpu":
        assert "h200" not in text.replace("hardware=h200", "")  # no machine named by hand


def test_the_test_steps_and_an_unknown_step(dry):
    _, code, text = dry
    tests = [c for c in _commands(text) if "-m pytest" in c]
    assert len(tests) == 2 and "--ignore=tests/test_multigpu_gpu.py" in tests[0]
    assert tests[1].endswith("tests/test_multigpu_gpu.py")
    assert code == 2 and "unknown step no_such_step" in text


def test_no_reference_names_the_old_script():
    for path in (ROOT / "Makefile", ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        assert "h200_session" not in path.read_text(), path
    assert "benchmarks/gpu_session.sh" in (ROOT / "docs/experiments.md").read_text()


# make setup ------------------------------------------------------------------------------------


def _make_setup(tmp_path: Path, *args: str, env: dict | None = None) -> list[str]:
    """The commands `make setup` would run (make -n), one a line."""
    proc = subprocess.run(
        ["make", "-n", "setup", f"PY={sys.executable}", "N_GPU=1", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.splitlines()


needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="no make here")


@needs_make
def test_setup_with_no_network_installs_only_the_carried_wheels(tmp_path):
    wheels = tmp_path / "wheels"
    lines = _make_setup(tmp_path, "OFFLINE=1", f"WHEELS={wheels}")
    pip = [line for line in lines if " -m pip install" in line]
    assert pip == [
        f"{sys.executable} -m pip install -q --no-index --find-links {wheels} --no-deps "
        f"{wheels}/*.whl"
    ]
    assert not any("-e " in line or "torch==" in line for line in lines)


@needs_make
def test_setup_finds_out_whether_the_index_answers(tmp_path):
    """OFFLINE=auto: offline where the wheel folder holds wheels and pip's index has no
    hydra-core (no index reachable); online where there are no wheels to fall back on."""
    wheels = tmp_path / "wheels"
    _wheel(wheels)
    lines = _make_setup(tmp_path, f"WHEELS={wheels}", env=NO_INDEX)
    assert any("--no-index --find-links" in line for line in lines)
    lines = _make_setup(tmp_path, f"WHEELS={tmp_path / 'none'}", env=NO_INDEX)
    assert any('pip install -q -e ".[gpu]"' in line for line in lines)
    assert not any("--no-index" in line for line in lines)
    lines = _make_setup(tmp_path, "OFFLINE=0", f"WHEELS={wheels}", env=NO_INDEX)
    assert not any("--no-index" in line for line in lines)
