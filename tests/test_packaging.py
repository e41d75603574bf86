"""Packaging: the namespace layout of the wheel, and the supervisor's independence from torch."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from qlora_supervise.supervisor.exit_codes import SupervisorExitCode

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_installs_under_the_namespace_only(tmp_path: Path) -> None:
    """The wheel holds qlora_supervise/{supervisor,policies,trainer_child} and no top-level supervisor."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
    )
    wheel = next(tmp_path.glob("qlora_supervise-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"qlora_supervise"}
    for package in ("supervisor", "policies", "trainer_child"):
        assert f"qlora_supervise/{package}/__init__.py" in names
    for room in ("contract", "recipe", "run", "merge"):
        assert f"qlora_supervise/trainer_child/{room}/__init__.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert (
        "qlora_supervise.supervisor.commands.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    )


def test_supervisor_does_not_import_torch() -> None:
    """Importing every module of the supervisor, the policies and the contract loads no torch stack."""
    code = (
        "import sys, pkgutil, importlib\n"
        "import qlora_supervise.supervisor as s, qlora_supervise.policies as p\n"
        "import qlora_supervise.trainer_child.contract as c\n"
        "for pkg in (s, p, c):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "names = ('torch', 'transformers', 'peft', 'trl', 'bitsandbytes', 'datasets')\n"
        "heavy = [m for m in names if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_help_documents_exit_codes() -> None:
    """`qlora-supervise run --help` gives each code of SupervisorExitCode its own entry, and no other."""
    out = subprocess.run(
        [sys.executable, "-m", "qlora_supervise.supervisor.commands.cli", "run", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    section = out[out.index("\nexit codes:\n") :]
    entries = re.findall(r"^  (\d+) +\w", section, re.MULTILINE)  # "  3    gave up: ..." starts a line
    entries += re.findall(r", (\d+) stopped by", section)  # "130  stopped by SIGINT, 143 stopped by SIGTERM"
    assert sorted(map(int, entries)) == sorted(int(code) for code in SupervisorExitCode)
