"""``qlora-supervise merge RUN_DIR [--out DIR] [--device auto|cpu|cuda]``: merge a finished adapter.

``run``'s merge child started on its own, from the newest training attempt's spec pointed at ``--out``
(default ``RUN_DIR/merged``), in ``RUN_DIR/merge-command/``; a GPU ``oom_merge`` is retried once on the
CPU. The journal is not touched, and the run's lock is held throughout (refused, exit 2, while a
supervisor runs). The adapter's step is added to ``merge.json`` and to ``merge-command/merged.json``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from qlora_supervise.supervisor.commands import BadInput
from qlora_supervise.supervisor.exit_codes import SupervisorExit, SupervisorExitCode
from qlora_supervise.supervisor.facts.append import open_append_binary
from qlora_supervise.supervisor.facts.units import format_bytes
from qlora_supervise.supervisor.jobfile.system_paths import system_folder
from qlora_supervise.supervisor.record.journal import Outcome, Phase, read_attempts
from qlora_supervise.supervisor.record.rundir import RUN_UMASK, AttemptDir, RunDir, ensure_dir
from qlora_supervise.supervisor.watching.gpu import visible_gpu_count
from qlora_supervise.trainer_child.contract import processes
from qlora_supervise.trainer_child.contract.codes import ExitCode
from qlora_supervise.trainer_child.contract.durable import write_text_atomic
from qlora_supervise.trainer_child.contract.report import ErrorReport
from qlora_supervise.trainer_child.contract.spec import AttemptSpec

MERGED_RECORD = "merged.json"  # in merge-command/: what the last merge made, from which step
MERGE_REPORT = "merge.json"  # written by the merge child into merged/ before its rename
DEVICE_ENV = "QLORA_SUPERVISE_MERGE_DEVICE"  # trainer_child.merge.DEVICE_ENV (not imported: torch side)


def merge_command(run_dir: str, out: str | None = None, device: str = "auto") -> int:
    rd = RunDir(Path(run_dir).resolve())
    if device == "cuda" and not visible_gpu_count():
        cpu = "use --device cpu (or auto, which picks the CPU on this machine)"
        raise BadInput(f"merge --device cuda: no GPU is visible here (NVML finds none); {cpu}")
    if not (rd.adapter / "adapter_config.json").is_file():
        why = f"merge a run that finished training (qlora-supervise status {run_dir})"
        raise BadInput(f"{rd.adapter}: no adapter_config.json; {why}")
    os.umask(RUN_UMASK)  # what the child creates (its events, the merged model) is 0640 / 0750 too
    merged = Path(out).resolve() if out else rd.merged
    if (system := system_folder(merged)) is not None:
        raise BadInput(f"merge --out {merged}: {system[0]}; choose a folder of your own")
    # The lock held throughout: nothing replaces the adapter meanwhile.
    with rd.lock(busy=f"a supervisor is running on {rd.root}: merge once it has ended, or stop it first"):
        step = adapter_step(rd)
        work = _merge_spec(rd, merged)
        code, report = _run_child(work, device)
        if report is not None and report.is_oom and device != "cpu":
            why = report.message[:200]
            print(f"oom_merge on the GPU ({why}): merging on the CPU instead", file=sys.stderr)
            code, report = _run_child(work, "cpu")
        if code != 0:
            why = report.message[:500] if report else f"exit status {code}"
            raise SupervisorExit(SupervisorExitCode.NOT_RETRYABLE, f"merge failed: {why} (log: {work.log})")
        if (numbers := read_json(merged / MERGE_REPORT)) is not None:
            numbers["adapter_step"] = step
            write_text_atomic(merged / MERGE_REPORT, json.dumps(numbers, indent=2))
        record = {"merged_dir": str(merged), "adapter_step": step, "time": time.time()}
        write_text_atomic(rd.merge_command / MERGED_RECORD, json.dumps(record, indent=2))
        print(f"merged: {merged} (the adapter of step {step if step is not None else '?'})")
        if numbers:
            peaks = [
                f"{label} {format_bytes(numbers[key])}"
                for key, label in (("gpu_peak_bytes", "GPU peak"), ("host_peak_bytes", "host peak"))
                if isinstance(numbers.get(key), int)
            ]
            print(f"  {numbers['device']}, {numbers['dtype']}, {numbers['seconds']} s, {', '.join(peaks)}")
    return 0


def adapter_step(rd: RunDir) -> int | None:
    """The step of the run's adapter: the journal's last training attempt that succeeded."""
    records, _ = read_attempts(rd.attempts)
    done = [r for r in records if r.phase is Phase.TRAIN and r.outcome is Outcome.SUCCEEDED]
    return done[-1].steps_completed if done else None


def merged_record(rd: RunDir) -> dict[str, Any] | None:
    """What the last ``qlora-supervise merge`` recorded: ``merged_dir``, ``adapter_step``, ``time``."""
    return read_json(rd.merge_command / MERGED_RECORD)


def merge_report(rd: RunDir) -> dict[str, Any] | None:
    """The merge child's own numbers (time, device, dtype, peaks), when a merge finished."""
    return read_json(rd.merged / MERGE_REPORT)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _merge_spec(rd: RunDir, merged: Path) -> AttemptDir:
    """The newest training attempt's spec pointed at this merge's own files, in ``merge-command/``."""
    if not (specs := sorted(rd.root.glob("attempt-[0-9][0-9][0-9]/spec.json"))):
        raise BadInput(f"{rd.root}: no attempt-NNN/spec.json to merge from")
    base = AttemptSpec.from_json(specs[-1].read_text(encoding="utf-8"))
    work = AttemptDir(ensure_dir(rd.merge_command))  # never through a link (rundir)
    for stale in (work.error, work.events):
        stale.unlink(missing_ok=True)
    spec = dataclasses.replace(
        base,
        knobs=dataclasses.replace(base.knobs, merge_on_cpu=False),
        events_file=str(work.events),
        error_file=str(work.error),
        adapter_dir=str(rd.adapter),
        merged_dir=str(merged),
        resume_from=None,
    )
    write_text_atomic(work.spec, spec.to_json())
    return work


def _run_child(work: AttemptDir, device: str) -> tuple[int, ErrorReport | None]:
    work.error.unlink(missing_ok=True)
    env = {**os.environ, DEVICE_ENV: device, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", processes.MERGE, "--spec", str(work.spec)]
    with open_append_binary(work.log) as log:
        code = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    if code != ExitCode.OK and work.error.is_file():
        with contextlib.suppress(OSError, ValueError):
            return code, ErrorReport.from_json(work.error.read_text(encoding="utf-8"))
    return code, None
