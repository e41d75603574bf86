"""Shared fixtures. The trainer-child fixtures live in ``_child.py``; registered here so the
session-scoped tiny model is built once for all test modules."""

import contextlib
import itertools
import os
import re
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _child import tiny_dir_fixture  # noqa: F401 - registers the `tiny_dir` fixture
from _pytest.mark.expression import Expression

# Python's default, even where the environment turned it off (PYTHONDONTWRITEBYTECODE): otherwise
# every process of the test run (the xdist workers, the supervisors and scripted children the tests
# start, dozens each) compiles the package, and pytest rewrites the test modules, again from source:
# about 3 s of CPU per worker's collection and 0.1 s per supervisor started. Set here, in the process
# that starts the workers, before it starts them; the caches go to __pycache__ (git ignores them).
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False


def pytest_configure(config: pytest.Config) -> None:
    """Under ``-n 2`` each worker's trainer processes compute on one thread (torch's default is one
    per core): two workers' trainers at once on the 2 cores, each with two spinning OpenMP threads,
    ran up to 3x slower (as torchrun's ranks do, which torchrun sets to one thread each). The memory
    baseline the caps are placed above (``_machine.import_baseline``) is measured the same way."""
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")


#: Modules whose tests read one module-scoped fixture's real run: under ``-n 2`` all of a module's
#: tests go to one worker, so that run is made once (every other test goes alone to a free worker).
SHARED_RUN_MODULES = ("test_torchrun_real.py", "test_speed_trial.py", "test_child_rung_costs.py")

#: Fast modules that run torch, transformers and peft in the test process: one unit together, so
#: that one worker alone pays those imports (seconds each; transformers' model modules about 5 s).
#: test_speed_trial's fast tests import the child's speed trial (torch); its shared run comes along.
IN_PROCESS_TORCH = (
    "test_activation_offload.py",
    "test_attention_default.py",
    "test_bench_recovery.py",
    "test_bf16_head.py",
    "test_child_failure.py",
    "test_rank.py",
    "test_rank_stop.py",
    "test_speed_trial.py",
)


#: The slow modules whose tests take longest (a foreign tool's venv, a supervised run of several
#: attempts, two ranks), measured: collected first of all (the fast ones below: first of the fast).
LONGEST_FIRST = (
    "test_trainer_tools_real.py",
    "test_trainer_trial_real.py",
    "test_supervise_real.py",
    "test_spare.py",
    "test_families.py",
    "test_trainer_trl_real.py",
    # The fast modules whose tests wait longest on real processes and real time (hang and stop
    # timeouts, paced scripted children), measured: first of the fast tests, so that the short
    # tests fill the end of `-n 2` and neither worker finishes alone on a long one.
    "test_loop.py",
    "test_trainer_shim.py",
    "test_hardening_loop.py",
    "test_reliability_loop.py",
    "test_optional_outputs.py",
    "test_creep.py",
    "test_reliability_tools.py",
    "test_trainer_stand_ins.py",
)


def _order(item: pytest.Item) -> tuple[bool, int]:
    name = item.path.name
    return item.get_closest_marker("slow") is None, (
        LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    )


_MODULE_MARKS = re.compile(r"^pytestmark = (pytest\.mark\.\w+|\[[^\]\n]*\])\s*(?:#.*)?$", re.MULTILINE)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A module whose ``pytestmark`` line marks every test of it so that ``-m`` deselects them all
    (the slow modules under ``-m "not slow"``) is not imported: it would be deselected anyway, and
    importing it cost each xdist worker seconds (some import torch, peft and bitsandbytes)."""
    markexpr = config.getoption("markexpr")
    if not markexpr or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    found = _MODULE_MARKS.search(collection_path.read_text(encoding="utf-8"))
    if found is None:
        return None
    module = set(re.findall(r"pytest\.mark\.(\w+)", found.group(1)))
    # Its tests may add any of the other registered marks: deselected only if no combination is kept.
    others = sorted({line.split(":")[0] for line in config.getini("markers")} - module)
    expression = Expression.compile(markexpr)
    combos = (set(c) for n in range(len(others) + 1) for c in itertools.combinations(others, n))
    return not any(expression.evaluate(lambda name, c=c, **_: name in module | c) for c in combos) or None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests first, the longest of them first of all (the order otherwise kept): under
    ``-n 2`` the workers start on the long real-process tests and finish on the short ones, so
    neither waits alone on a long one at the end."""
    items.sort(key=_order)


@pytest.hookimpl(optionalhook=True)  # without xdist (-p no:xdist) the hook is unknown: not an error
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``-n 2``'s scheduler: each test a unit of its own, given to whichever worker is free, in the
    order collected, except the tests of a :data:`SHARED_RUN_MODULES` module, one unit together,
    and those of the :data:`IN_PROCESS_TORCH` modules, one unit (xdist's own ``--dist loadgroup``
    does not group with pytest 9: it renames a private field). Only for the default
    ``--dist load``; another ``--dist`` named on the command line is kept."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneByOne(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if module.endswith(IN_PROCESS_TORCH):
                return "in-process torch"
            return module if module.endswith(SHARED_RUN_MODULES) else nodeid

    return OneByOne(config, log)


@pytest.fixture(scope="session")
def _state_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Iterator[str]]:
    """Fresh peak-store folder names under one session folder (created by the store when it writes)."""
    base = tmp_path_factory.mktemp("state")
    yield (str(base / str(n)) for n in itertools.count())


@pytest.fixture(autouse=True)
def _test_process_state(_state_dirs: Iterator[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """What every test gets, undone after it (one fixture: ~1,300 tests pay each fixture's setup):

    * the per-host peak store in a folder of its own in a temp dir, never ~/.local/state (a name
      only: the store creates it when it writes, most tests never do);
    * no scripted child's plan (``SCRIPTED_CHILD_PLAN``, which the loop tests' ``_job`` points at
      their own tmp file), so no test inherits another's plan;
    * in-process plans read a fixed, roomy host (256 GiB available, no cgroup limit) instead of the
      machine's free RAM, so that a busy or small test machine does not change what a plan starts
      from; tests/test_host_memory.py tests the host budget itself (its sources, reserve and limits).
    """
    from qlora_supervise.supervisor.watching import host

    monkeypatch.setenv("QLORA_SUPERVISE_STATE_DIR", next(_state_dirs))
    monkeypatch.delenv("SCRIPTED_CHILD_PLAN", raising=False)
    monkeypatch.setattr(host, "host_room", lambda: (256 << 30, None))


@pytest.fixture
def notify_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A datagram socket bound to a short path, named by NOTIFY_SOCKET (as systemd does)."""
    directory = Path(tempfile.mkdtemp(prefix="sdn", dir="/tmp"))  # sun_path is limited to 108 bytes
    path = directory / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    try:
        yield sock
    finally:
        sock.close()
        path.unlink(missing_ok=True)
        directory.rmdir()


_PR_SET_CHILD_SUBREAPER = 36


@pytest.fixture
def reaps_orphans() -> Iterator[None]:
    """This test's process adopts the orphans of the processes it starts (a supervisor it SIGKILLs
    leaves its child behind) and reaps each as it exits, as a host's init does at once. A container's
    PID 1 may reap adopted orphans a second or two late, and until then the exited child still looks
    alive to the next supervisor that waits for it to leave. Zombies left adopted are reaped after."""
    import ctypes

    import psutil

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1)
    try:
        yield
    finally:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 0)
        for child in psutil.Process().children():
            with contextlib.suppress(psutil.Error, ChildProcessError):
                if child.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(child.pid, os.WNOHANG)
