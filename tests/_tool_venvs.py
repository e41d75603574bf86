"""A foreign tool in a venv of its own, built once per machine and user, cached (tests only).

The venv gets this machine's torch release (``pip install torch==X``: on the development and CI
machines pip's configuration finds the CPU build on their disk, in seconds; elsewhere pip may take
PyPI's CUDA build of the same release, several GB), then the tool's requirements file from
``tests/fixtures/tool-venvs/``, then the tool itself without its dependencies (its own pins name
CUDA-only kernels, cloud filesystems and UIs that its QLoRA path never imports).

That build (~3 GB, minutes) is the same for every clone on a machine, so it lives in the user's
cache, ``${XDG_CACHE_HOME:-~/.cache}/qlora-supervise/tool-venvs/<tool>-<version>-<key>``, the key
being a hash of what decides its contents (the requirements file, the tool's version, the torch
build, Python): a clean clone on the same machine reuses it, a changed requirement set or a fresh
machine builds a new one. ``QLORA_SUPERVISE_TOOL_VENVS`` names another folder for the cache. The
build runs under a file lock, so two test workers (``-n 2``) or two clones build it once.

qlora-supervise is made importable in the tool's interpreter the way the README asks of a user
(``pip install --no-deps`` into the tool's venv), here as links to this working tree, so the shim
that rides in the tool's process is the code under test. The links are per tree: the test's
interpreter is a small venv of this clone's own, ``.tool-venvs/<tool>-<version>/``, whose
site-packages holds ``qlora_supervise`` (links to this tree's three packages) and a ``.pth`` file
that adds the cached venv's site-packages after it.

A build that cannot finish (no package index, a timeout) is a skip that says why and how to
build it by hand, unless ``QLORA_SUPERVISE_REQUIRE_TOOL_VENVS=1`` (``.ci/run`` sets it: CI has the
package index, so there a build that fails is a failure, not a quiet skip). A finished one is
stamped; a cached folder without its stamp (a build killed half-way) is built again.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: This clone's own small venvs (the links to this tree), beside the cached builds they extend.
LOCAL = ROOT / ".tool-venvs"
BUILD_TIMEOUT_S = 600.0  # a step; the whole build takes ~90 s to 4 min here
REQUIRE = "QLORA_SUPERVISE_REQUIRE_TOOL_VENVS"
STAMP = "qlora-supervise-test-stamp"


def cache_root() -> Path:
    """Where the built tool venvs are kept for every clone of this user on this machine."""
    named = os.environ.get("QLORA_SUPERVISE_TOOL_VENVS")
    if named:
        return Path(named)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "qlora-supervise" / "tool-venvs"


@dataclass(frozen=True)
class Tool:
    name: str  # the package's name on the index
    version: str

    @property
    def requirements(self) -> Path:
        return ROOT / "tests" / "fixtures" / "tool-venvs" / f"{self.name}.txt"

    @property
    def key(self) -> str:
        """What decides the built venv's contents, hashed: a change builds a new one."""
        text = "\n".join(
            [self.name, self.version, self.requirements.read_text(), _torch_version(), sys.version]
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def built(self) -> Path:
        """The cached venv with the tool and its requirements (shared by every clone)."""
        return cache_root() / f"{self.name}-{self.version}-{self.key}"

    @property
    def venv(self) -> Path:
        """This clone's venv: the cached one's packages and links to this tree."""
        return LOCAL / f"{self.name}-{self.version}"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


AXOLOTL = Tool("axolotl", "0.19.0")


def _torch_version() -> str:
    """The installed torch's version, read from its metadata (the test process never imports torch)."""
    return importlib.metadata.version("torch")


def _torch_release() -> str:
    return _torch_version().split("+")[0]


def _steps(tool: Tool) -> list[list[str]]:
    python = tool.built / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    return [
        [sys.executable, "-m", "venv", str(tool.built)],
        [*pip, f"torch=={_torch_release()}"],
        [*pip, "-r", str(tool.requirements)],
        [*pip, "--no-deps", f"{tool.name}=={tool.version}"],
    ]


def _site_packages(python: Path) -> Path:
    done = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(done.stdout.strip())


def _build(tool: Tool) -> None:
    """The cached venv, built when it has no stamp (the caller holds the lock)."""
    stamp_file = tool.built / STAMP
    if stamp_file.is_file() and stamp_file.read_text() == tool.key:
        return
    shutil.rmtree(tool.built, ignore_errors=True)
    by_hand = " && ".join(" ".join(step) for step in _steps(tool))
    for step in _steps(tool):
        try:
            done = subprocess.run(step, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _cannot(f"building {tool.built} took over {BUILD_TIMEOUT_S:.0f} s at `{' '.join(step)}`")
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            _cannot(
                f"{tool.name} {tool.version}'s venv cannot be built on this machine "
                f"(`{' '.join(step)}` failed: {' / '.join(tail)}); by hand: {by_hand}"
            )
    stamp_file.write_text(tool.key)


def _link_this_tree(tool: Tool) -> None:
    """This clone's venv: ``qlora_supervise`` as links to this tree's three packages, and a
    ``.pth`` that adds the cached venv's site-packages (its own ``.pth`` files processed)."""
    marker = tool.venv / "qlora-supervise-extends"
    if not (tool.python.is_file() and marker.is_file() and marker.read_text() == str(tool.built)):
        shutil.rmtree(tool.venv, ignore_errors=True)  # none yet, another build's, or a whole venv of old
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tool.venv)], check=True)
        marker.write_text(str(tool.built))
    site = _site_packages(tool.python)
    base = _site_packages(tool.built / "bin" / "python")
    (site / "qlora_supervise_tool_venv.pth").write_text(f"import site; site.addsitedir({str(base)!r})\n")
    package = site / "qlora_supervise"
    package.mkdir(exist_ok=True)
    for name in ("supervisor", "policies", "trainer_child"):
        link = package / name
        if link.is_symlink() and link.resolve() == ROOT / name:
            continue
        link.unlink(missing_ok=True)
        link.symlink_to(ROOT / name)


def tool_python(tool: Tool) -> Path:
    """This clone's interpreter for the tool, the cached venv built first when missing or stale;
    a skip (a failure under ``QLORA_SUPERVISE_REQUIRE_TOOL_VENVS=1``) when it cannot be built."""
    tool.built.parent.mkdir(parents=True, exist_ok=True)
    LOCAL.mkdir(exist_ok=True)
    with open(tool.built.parent / f"{tool.built.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker or clone may be building it: wait
        _build(tool)
        with open(LOCAL / f"{tool.venv.name}.lock", "w") as local_lock:
            fcntl.flock(local_lock, fcntl.LOCK_EX)
            _link_this_tree(tool)
    return tool.python


def _cannot(why: str) -> NoReturn:
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(why)
    pytest.skip(why)
