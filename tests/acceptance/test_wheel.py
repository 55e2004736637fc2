"""The wheel is the library and the operator CLI, and it works without the repository.

Builds the wheel from a copy of what it is built from (no stale build/ of a checkout can leak
into it), requires a build log free of warnings, installs it into a fresh virtualenv and runs
the command there from an empty directory, with the repository nowhere on ``sys.path``. The
fresh venv borrows this venv's third-party packages through a folder of links that leaves out
every txbox distribution (the editable library and the development tools).
"""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.acceptance, pytest.mark.slow]

#: What the wheel is built from (pyproject.toml's packages, package-dir and readme).
SOURCES = ("pyproject.toml", "README.md", "framework", "migrations")
#: Our own distributions in this venv: kept out of the fresh one, so only the wheel provides txbox.
OURS = re.compile(r"^(txbox|__editable__)|\.pth$", re.IGNORECASE)
STEP_TIMEOUT = 45


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "TXBOX_", "VIRTUAL_ENV"))}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(argv: list[str | Path], cwd: Path, status: int = 0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        argv, cwd=cwd, env=_env(), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=STEP_TIMEOUT,
        check=False,
    )  # fmt: skip
    assert done.returncode == status, f"{argv} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src, dist = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    # -v shows the build backend's own output, where setuptools' warnings appear; offline
    # (--no-index, the venv's setuptools); PYTHONDONTWRITEBYTECODE is left out of the env
    # (see _env) as it makes setuptools warn that it skips byte-compiling.
    build = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-v",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            dist,
            src,
        ],
        cwd=src,
    )
    log = build.stdout + build.stderr
    warnings = [line for line in log.splitlines() if "warn" in line.lower()]
    assert not warnings, "the wheel's build warns:\n" + "\n".join(warnings)
    (built,) = dist.glob("txbox-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", "--without-pip", root / "venv"], cwd=root)
    python = root / "venv" / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel], cwd=root)
    links = root / "dependencies"
    links.mkdir()
    (ours,) = {Path(p) for p in site.getsitepackages()}
    for entry in ours.iterdir():
        if not OURS.search(entry.name):
            (links / entry.name).symlink_to(entry)
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root).stdout
    (Path(purelib.strip()) / "dependencies.pth").write_text(f"{links}\n")
    return root / "venv" / "bin"


def test_the_wheel_runs_the_command_without_the_repository(venv: Path, tmp_path: Path) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert _run([venv / "txbox", "--version"], cwd=tmp_path).stdout.strip() == f"txbox {version}"

    usage = _run([venv / "txbox", "--help"], cwd=tmp_path).stdout
    listed = {line.split()[0] for line in usage.splitlines() if line.startswith("  ")}
    assert {"migrate", "publisher", "receiver", "worker", "dlq", "dashboard", "analyze"} <= listed
    assert not listed & {"bench", "chaos", "demo"}, "the development tools must not come with the wheel"

    assert "CREATE TABLE txbox.outbox" in _run([venv / "txbox", "migrate", "--sql"], cwd=tmp_path).stdout

    where = _run(
        [
            venv / "python",
            "-c",
            "import framework, importlib.util as u; print(framework.__file__, u.find_spec('txbox_tools'))",
        ],
        cwd=tmp_path,
    ).stdout.split()
    assert Path(where[0]).is_relative_to(venv.parent) and where[1] == "None", where

    missing = _run([venv / "txbox", "bench", "relay"], cwd=tmp_path, status=2).stderr
    assert "make setup" in missing and "Traceback" not in missing, missing
