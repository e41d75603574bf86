"""``qlora-supervise merge RUN_DIR [--out DIR] [--device auto|cpu|cuda]``: merge a finished adapter.

The same merge child as ``run``'s final phase (``train.merge: true``), started on its own:
its spec is the newest training attempt's, pointed at ``--out`` (default ``RUN_DIR/merged``),
written to ``RUN_DIR/merge-command/``. The child plans the memory (GPU and host RAM) and picks
the device for ``auto``; a memory failure on the GPU (``oom_merge``) is retried once on the
CPU. The journal is not touched: this is not an attempt of the run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from qlora_supervise.supervisor.exit_codes import SupervisorExit, SupervisorExitCode
from qlora_supervise.supervisor.jobfile.units import format_bytes
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.trainer_child.contract import entry
from qlora_supervise.trainer_child.contract.codes import ExitCode
from qlora_supervise.trainer_child.contract.durable import write_text_atomic
from qlora_supervise.trainer_child.contract.report import ErrorReport
from qlora_supervise.trainer_child.contract.spec import AttemptSpec

DEVICE_ENV = "QLORA_SUPERVISE_MERGE_DEVICE"  # trainer_child.merge.DEVICE_ENV (not imported: torch side)


def merge_command(run_dir: str, out: str | None = None, device: str = "auto") -> int:
    rd = RunDir(Path(run_dir).resolve())
    if not (rd.adapter / "adapter_config.json").is_file():
        raise SupervisorExit(
            SupervisorExitCode.BAD_JOB,
            f"{rd.adapter}: no adapter_config.json; merge a run that finished training "
            f"(qlora-supervise status {run_dir})",
        )
    spec = _merge_spec(rd, Path(out).resolve() if out else rd.merged)
    code, report = _run_child(spec, device)
    if report is not None and report.is_oom and device != "cpu":
        print(f"oom_merge on the GPU ({report.message[:200]}): merging on the CPU instead", file=sys.stderr)
        code, report = _run_child(spec, "cpu")
    if code != 0:
        where = Path(spec.error_file).parent / "child.log"
        why = report.message[:500] if report else f"exit status {code}"
        raise SupervisorExit(SupervisorExitCode.NOT_RETRYABLE, f"merge failed: {why} (log: {where})")
    numbers = _report_at(Path(spec.merged_dir))
    print(f"merged: {spec.merged_dir}")
    if numbers:
        peaks = [
            f"{label} {format_bytes(numbers[key])}"
            for key, label in (("gpu_peak_bytes", "GPU peak"), ("host_peak_bytes", "host peak"))
            if isinstance(numbers.get(key), int)
        ]
        print(f"  {numbers['device']}, {numbers['dtype']}, {numbers['seconds']} s, {', '.join(peaks)}")
    return 0


def _report_at(merged: Path) -> dict[str, Any] | None:
    try:
        value = json.loads((merged / "merge.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _merge_spec(rd: RunDir, merged: Path) -> AttemptSpec:
    """The newest training attempt's spec, pointed at this merge's own files."""
    specs = sorted(rd.root.glob("attempt-[0-9][0-9][0-9]/spec.json"))
    if not specs:
        raise SupervisorExit(SupervisorExitCode.BAD_JOB, f"{rd.root}: no attempt-NNN/spec.json to merge from")
    base = AttemptSpec.from_json(specs[-1].read_text(encoding="utf-8"))
    work = rd.root / "merge-command"
    work.mkdir(exist_ok=True)
    for stale in ("error.json", "child-events.jsonl"):
        (work / stale).unlink(missing_ok=True)
    spec = dataclasses.replace(
        base,
        knobs=dataclasses.replace(base.knobs, merge_on_cpu=False),
        events_file=str(work / "child-events.jsonl"),
        error_file=str(work / "error.json"),
        adapter_dir=str(rd.adapter),
        merged_dir=str(merged),
        resume_from=None,
    )
    write_text_atomic(work / "spec.json", spec.to_json())
    return spec


def _run_child(spec: AttemptSpec, device: str) -> tuple[int, ErrorReport | None]:
    work = Path(spec.error_file).parent
    Path(spec.error_file).unlink(missing_ok=True)
    env = {**os.environ, DEVICE_ENV: device, "PYTHONUNBUFFERED": "1"}
    command = [
        sys.executable,
        "-m",
        entry.MERGE,
        "--spec",
        str(work / "spec.json"),
    ]
    with (work / "child.log").open("ab") as log:
        code = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    report = None
    if code != ExitCode.OK and Path(spec.error_file).is_file():
        try:
            report = ErrorReport.from_json(Path(spec.error_file).read_text(encoding="utf-8"))
        except (OSError, ValueError, TypeError):
            report = None
    return code, report
