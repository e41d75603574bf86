"""The approaches, each run on one scenario within a time limit; each leaves a run directory.

* ``supervised``: ``qlora-supervise run job.yaml --plain``, as a user runs it (pre-flight on, the
  warm spare as the job's default leaves it);
* ``as-written`` / ``as-written-no-spare``: the same with ``--as-written``, so the OOM the job as
  written runs into happens and the ladder recovers from it, with ``supervise.warm_spare: true``
  and ``false`` (the field is written only where the installed schema has it: before the spare
  existed, ``as-written`` is the no-spare run and ``as-written-no-spare`` is skipped);
* ``restart-loop``: our trainer child run directly, again and again with the same spec, each time
  from the newest complete checkpoint, up to ``RESTARTS`` restarts (torchrun ``--max-restarts 3``,
  systemd ``Restart=on-failure``, a bash ``until`` loop: nothing changes between attempts);
* ``auto-batch``: the same recipe in one process with ``auto_find_batch_size`` (:mod:`.auto_batch`).

``supervised-spare`` (for the overhead) is ``supervised`` with ``warm_spare: true``.

``bare`` (for the overhead) runs one supervised attempt's spec again with no supervisor.
Every approach gets the same child environment (``supervisor.loop.child.child_env`` of the job's
knobs: the allocator settings), so none differs from another by an environment variable.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from ..scenarios import gpu_ladder
from . import jobs
from .launch import Launch, launch
from .scenarios import Scenario

APPROACHES = ("supervised", "as-written", "as-written-no-spare", "restart-loop", "auto-batch")
RESTARTS = 3
AUTO_BATCH_SCRIPT = Path(__file__).resolve().with_name("auto_batch.py")


@dataclasses.dataclass(frozen=True)
class Place:
    """Where a scenario's approaches run: its assets, the run directories, the kept journals."""

    scenario: Scenario
    assets: Path  # the shape's directory in the cache (model/, data files)
    runs: Path  # run directories (checkpoints included; not kept)
    keep: Path  # OUT/<scenario>: journals and logs, no checkpoints
    tiny: bool

    def run_dir(self, approach: str) -> Path:
        path = self.runs / approach
        shutil.rmtree(path, ignore_errors=True)
        return path


def attempt_env(spec_json: str) -> dict[str, str]:
    from qlora_supervise.supervisor.loop.child import child_env
    from qlora_supervise.trainer_child.contract.spec import AttemptSpec

    return child_env(dict(os.environ), AttemptSpec.from_json(spec_json).knobs)


def write_spec(spec: Any) -> Path:
    attempt_dir = Path(spec.events_file).parent
    attempt_dir.mkdir(parents=True, exist_ok=True)
    path = attempt_dir / "spec.json"
    path.write_text(spec.to_json(), encoding="utf-8")
    return path


def supervised(place: Place, variant: str, limit_s: float, name: str | None = None) -> dict[str, Any]:
    """``qlora-supervise run`` on the scenario's job (``variant``: see the module docstring), in
    the run directory ``name`` (default: the variant's)."""
    spare = jobs.SPARE_SETTING[variant]
    has_field = jobs.has_warm_spare_field()
    if spare is False and not has_field:
        return {"skipped": "no supervise.warm_spare in this installation: as-written has no spare"}
    run_dir = place.run_dir(name or variant)
    job = jobs.write_job(place.scenario, place.assets, run_dir, place.tiny, spare if has_field else None)
    argv = [*gpu_ladder.cli(), "run", str(job), "--plain"]
    argv += ["--as-written"] if variant.startswith("as-written") else []
    result = launch(argv, place.keep / (name or variant) / "supervisor.log", limit_s)
    return {"run_dir": str(run_dir), "job": str(job), "warm_spare_field": has_field, "launch": _plain(result)}


def restart_loop(place: Place, limit_s: float, restarts: int = RESTARTS) -> dict[str, Any]:
    """The same spec again after each failure, from the newest complete checkpoint, no change."""
    from qlora_supervise.supervisor.loop.child import child_argv
    from qlora_supervise.trainer_child.contract.checkpoints import newest_complete_checkpoint

    run_dir = place.run_dir("restart-loop")
    job = jobs.write_job(place.scenario, place.assets, run_dir, place.tiny)
    base = jobs.job_spec(job)
    deadline = time.monotonic() + limit_s
    attempts: list[dict[str, Any]] = []
    for number in range(1, restarts + 2):
        newest = newest_complete_checkpoint(run_dir / "checkpoints")
        left = deadline - time.monotonic()
        if left <= 1:
            break
        spec = jobs.placed(base, run_dir, number, newest[1] if newest else None)
        path = write_spec(spec)
        result = launch(
            child_argv(path, "train"), path.with_name("child.log"), left, attempt_env(spec.to_json())
        )
        attempts.append(
            {"attempt": number, "resumed_from": newest[0] if newest else 0, "launch": _plain(result)}
        )
        if result.exit_code == 0 or result.timed_out:
            break
    return {"run_dir": str(run_dir), "job": str(job), "restarts_allowed": restarts, "attempts": attempts}


def auto_batch(place: Place, limit_s: float) -> dict[str, Any]:
    """The recipe under ``auto_find_batch_size``, in one process (:mod:`.auto_batch`)."""
    run_dir = place.run_dir("auto-batch")
    job = jobs.write_job(place.scenario, place.assets, run_dir, place.tiny)
    spec = jobs.placed(jobs.job_spec(job), run_dir, 1, None)
    path = write_spec(spec)
    argv = [sys.executable, str(AUTO_BATCH_SCRIPT), "--spec", str(path)]
    result = launch(argv, path.with_name("child.log"), limit_s, attempt_env(spec.to_json()))
    return {"run_dir": str(run_dir), "job": str(job), "launch": _plain(result)}


def bare(spec_json: str, run_dir: Path, limit_s: float) -> dict[str, Any]:
    """One supervised attempt's spec, from step 0 in a fresh directory, with no supervisor."""
    from qlora_supervise.supervisor.loop.child import child_argv
    from qlora_supervise.trainer_child.contract.spec import AttemptSpec

    shutil.rmtree(run_dir, ignore_errors=True)
    spec = jobs.placed(AttemptSpec.from_json(spec_json), run_dir, 1, None)
    path = write_spec(spec)
    result = launch(child_argv(path, "train"), path.with_name("child.log"), limit_s, attempt_env(spec_json))
    return {"run_dir": str(run_dir), "launch": _plain(result)}


def _plain(result: Launch) -> dict[str, Any]:
    return dataclasses.asdict(result)
