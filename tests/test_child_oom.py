"""Under a real RLIMIT_DATA cap the child reports the OOM, checkpoints the last step, and a
cheaper micro-batch resumes from there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _child import events, log_tail, make_spec, next_spec, report, run_child
from _machine import above_baseline

from qlora_supervise.trainer_child.contract.checkpoints import (
    CHECKPOINT_COMPLETE_MARKER,
    newest_complete_checkpoint,
)
from qlora_supervise.trainer_child.contract.codes import ExitCode

pytestmark = pytest.mark.slow
MIB = 1 << 20
#: Between the peak data segments of micro-batch 16 (~1730-1840 MiB) and micro-batch 8
#: (~1450-1575 MiB) at seq 512 with the CPU build of torch (a 0.37 GiB import baseline), measured
#: with bench/child_memory.py (since removed; docs/planning.md): 1664 MiB there, placed above the
#: baseline of the torch installed here.
CAP_HEADROOM = 1284 * MIB
HEAVY = {"micro_batch_size": 16, "grad_accum": 1, "max_seq_len": 512}


def test_cap_too_small_for_the_config_is_an_oom_with_stage_and_numbers(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """Micro-batch 16 under the cap exits 70 with a report naming forward/backward and tried_to_allocate."""
    cap = above_baseline(CAP_HEADROOM)
    spec = make_spec(tiny_dir, tmp_path, knobs=HEAVY, train={"max_steps": 3}, cpu_memory_limit=cap)
    assert run_child(spec) == ExitCode.OOM, log_tail(spec)
    failure = report(spec)
    assert failure.is_oom and failure.exit_code == ExitCode.OOM
    assert failure.stage in ("forward", "backward"), failure.traceback
    assert (failure.oom_numbers.tried_to_allocate or 0) > 0, failure.message
    assert failure.step == 0 and failure.emergency_checkpoint is None  # nothing learnt yet
    assert failure.device == "cpu"


def test_oom_after_progress_leaves_emergency_checkpoint_and_smaller_micro_batch_resumes(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """An OOM in step 3 checkpoints step 2; micro-batch 8 with doubled accumulation resumes at 2, finishes."""
    spec = make_spec(
        tiny_dir,
        tmp_path,
        knobs=HEAVY,
        train={"max_steps": 4, "save_steps": 100},
        cpu_memory_limit=above_baseline(CAP_HEADROOM),
    )
    # Injected fault: the cap arrives after step 2, as when memory becomes scarce mid-run.
    assert run_child(spec, QLORA_SUPERVISE_TEST_CAP_AFTER_STEP="2") == ExitCode.OOM, log_tail(spec)
    failure = report(spec)
    assert failure.stage in ("forward", "backward") and failure.step == 2
    assert failure.emergency_step == 2
    checkpoint = Path(failure.emergency_checkpoint or "")
    assert newest_complete_checkpoint(spec.checkpoints_dir) == (2, checkpoint)
    marker = json.loads((checkpoint / CHECKPOINT_COMPLETE_MARKER).read_text())
    assert marker["emergency"] is True and marker["knobs"]["micro_batch_size"] == 16

    cheaper = next_spec(spec, knobs={"micro_batch_size": 8, "grad_accum": 2}, resume_from=str(checkpoint))
    assert run_child(cheaper) == ExitCode.OK, log_tail(cheaper)
    seen = events(cheaper)
    resumed = next(e for e in seen if e["event"] == "resumed")
    assert (resumed["from_step"], resumed["micro_batch_size"], resumed["grad_accum"]) == (2, 8, 2)
    steps = {e["step"] for e in seen if e["event"] == "heartbeat" and e["step"] > 0}
    assert min(steps) >= 2 and {3, 4} <= steps
    assert next(e for e in seen if e["event"] == "finished")["step"] == 4


def test_cap_below_usage_after_imports_is_a_config_error(tiny_dir: Path, tmp_path: Path) -> None:
    """A CPU cap below what the child already uses after its imports exits 71 with the VmData it found."""
    spec = make_spec(tiny_dir, tmp_path, cpu_memory_limit=64 * MIB)
    assert run_child(spec) == ExitCode.CONFIG, log_tail(spec)
    failure = report(spec)
    assert failure.config_error and "VmData" in failure.message and failure.stage == "setup"
