"""A foreign tool in a venv of its own, built once and kept under ``.tool-venvs/`` (tests only).

The venv gets this machine's torch release (``pip install torch==X``: on the development and CI
machines pip's configuration finds the CPU build on their disk, in seconds; elsewhere pip may take
PyPI's CUDA build of the same release, several GB), then the tool's requirements file from
``tests/fixtures/tool-venvs/``, then the tool itself without its dependencies (its own pins name
CUDA-only kernels, cloud filesystems and UIs that its QLoRA path never imports). qlora-supervise
is made importable there the way the README asks of a user (``pip install --no-deps``), here as a
link to this working tree, so the shim that rides in the tool's process is the code under test.

A build that cannot finish (no package index, a timeout) is a skip that says why and how to
build it by hand, unless ``QLORA_SUPERVISE_REQUIRE_TOOL_VENVS=1`` (``.ci/run`` sets it: CI has the
package index, so there a build that fails is a failure, not a quiet skip). A finished one is
stamped, and reused while the stamp matches (the requirements, the torch build, Python, this tree).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
VENVS = Path(os.environ.get("QLORA_SUPERVISE_TOOL_VENVS", ROOT / ".tool-venvs"))
BUILD_TIMEOUT_S = 600.0  # a step; the whole build takes ~90 s here
REQUIRE = "QLORA_SUPERVISE_REQUIRE_TOOL_VENVS"


@dataclass(frozen=True)
class Tool:
    name: str  # the package's name on the index
    version: str

    @property
    def requirements(self) -> Path:
        return ROOT / "tests" / "fixtures" / "tool-venvs" / f"{self.name}.txt"

    @property
    def venv(self) -> Path:
        return VENVS / f"{self.name}-{self.version}"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


AXOLOTL = Tool("axolotl", "0.19.0")


def _torch_release() -> str:
    return torch.__version__.split("+")[0]


def _stamp(tool: Tool) -> str:
    text = "\n".join([tool.requirements.read_text(), torch.__version__, sys.version, str(ROOT)])
    return hashlib.sha256(text.encode()).hexdigest()


def _steps(tool: Tool) -> list[list[str]]:
    pip = [str(tool.python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    return [
        [sys.executable, "-m", "venv", str(tool.venv)],
        [*pip, f"torch=={_torch_release()}"],
        [*pip, "-r", str(tool.requirements)],
        [*pip, "--no-deps", f"{tool.name}=={tool.version}"],
    ]


def _link_this_tree(tool: Tool) -> None:
    """``qlora_supervise`` in the venv: a folder of links to this tree's three packages."""
    done = subprocess.run(
        [str(tool.python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    package = Path(done.stdout.strip()) / "qlora_supervise"
    package.mkdir(exist_ok=True)
    for name in ("supervisor", "policies", "trainer_child"):
        link = package / name
        if not link.is_symlink():
            link.symlink_to(ROOT / name)


def tool_python(tool: Tool) -> Path:
    """The tool venv's interpreter, built when missing or stale; a skip when it cannot be built."""
    stamp_file = tool.venv / "qlora-supervise-test-stamp"
    stamp = _stamp(tool)
    if stamp_file.is_file() and stamp_file.read_text() == stamp and tool.python.is_file():
        return tool.python
    shutil.rmtree(tool.venv, ignore_errors=True)
    tool.venv.parent.mkdir(parents=True, exist_ok=True)
    by_hand = " && ".join(" ".join(step) for step in _steps(tool))
    for step in _steps(tool):
        try:
            done = subprocess.run(step, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _cannot(f"building {tool.venv} took over {BUILD_TIMEOUT_S:.0f} s at `{' '.join(step)}`")
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            _cannot(
                f"{tool.name} {tool.version}'s venv cannot be built on this machine "
                f"(`{' '.join(step)}` failed: {' / '.join(tail)}); by hand: {by_hand}"
            )
    _link_this_tree(tool)
    stamp_file.write_text(stamp)
    return tool.python


def _cannot(why: str) -> NoReturn:
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(why)
    pytest.skip(why)
