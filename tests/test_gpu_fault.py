"""GPU faults: Xid events during an attempt become gpu_fault; fatal ones stop the run with exit 5."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from test_gpu import FakeNvml
from test_loop_fake_clock import FakeClock, _job, _run, _seams

from qlora_supervise.policies import decide as policy
from qlora_supervise.supervisor.diagnosis.classify import classify_exit
from qlora_supervise.supervisor.diagnosis.xid import describe, fatal_xid, overrule
from qlora_supervise.supervisor.exit_codes import EXIT_CODES_HELP, SupervisorExitCode
from qlora_supervise.supervisor.facts.failure import ChildExit, Failure, XidFacts
from qlora_supervise.supervisor.record.eventlog import read_events
from qlora_supervise.supervisor.record.journal import read_attempts
from qlora_supervise.supervisor.watching.gpu import GpuMonitor
from qlora_supervise.trainer_child.contract.codes import ExitCode, FailureKind, Stage
from qlora_supervise.trainer_child.contract.spec import Knobs

K = FailureKind
CRASHED = ChildExit(returncode=int(ExitCode.FAILED))
ILLEGAL = "RuntimeError: CUDA error: an illegal memory access was encountered"


def _failure(kind: FailureKind) -> Failure:
    return Failure(kind, Stage.FORWARD, {}, "error report: ...")


def test_a_fatal_xid_decides_whatever_the_child_said() -> None:
    """Xid 79 (off the bus) during an attempt makes even an OOM or a hang a fatal gpu_fault."""
    for kind in (K.OOM_FORWARD, K.HANG, K.OTHER):
        fault = overrule(_failure(kind), (13, 79))
        assert fault.kind is K.GPU_FAULT and fault.xid == XidFacts((13, 79), 79) and fault.numbers == {}
        assert fault.numbers_json() == {"xid": [13, 79], "fatal_xid": 79}  # the journal's shape
        assert "Xid 79 (GPU has fallen off the bus, fatal)" in fault.evidence


def test_a_non_fatal_xid_decides_only_a_failure_that_is_not_an_oom() -> None:
    """Xid 31 (page fault) explains an illegal-access crash, not an OOM, and never a config error."""
    assert overrule(_failure(K.OTHER), (31,)).kind is K.GPU_FAULT
    assert overrule(_failure(K.OOM_BACKWARD), (31,)).kind is K.OOM_BACKWARD
    assert overrule(_failure(K.CONFIG_ERROR), (31, 31)).kind is K.CONFIG_ERROR
    assert overrule(_failure(K.OTHER), ()).kind is K.OTHER
    failure = classify_exit(CRASHED, None, ILLEGAL, xid_events=(31,))
    assert failure.kind is K.GPU_FAULT and failure.xid == XidFacts((31,)) and failure.fatal_xid is None
    assert "fatal_xid" not in failure.numbers_json()
    assert "not an out-of-memory error" in failure.evidence  # the child's own failure is kept


def test_the_xid_table_names_the_fatal_ones() -> None:
    """Off the bus, uncorrectable ECC and NVLink errors are fatal; application-side Xids are not."""
    assert [code for code in (13, 31, 43, 45, 48, 63, 64, 74, 79, 92, 94, 95) if fatal_xid((code,))] == [
        48, 63, 64, 74, 79, 94, 95,
    ]  # fmt: skip
    assert describe((999,)) == "Xid 999 (see NVIDIA's Xid catalogue)"


def test_policy_gives_up_on_a_fatal_xid_and_retries_another_once() -> None:
    """A fatal gpu_fault is not retryable; a non-fatal one restarts unchanged once, then gives up."""
    knobs = Knobs(model="m")
    fatal = Failure(K.GPU_FAULT, Stage.FORWARD, {}, "", xid=XidFacts((48,), 48))
    decision = policy.decide(fatal, knobs, [policy.PastAttempt(knobs, K.GPU_FAULT, 0)], policy.Settings())
    assert isinstance(decision, policy.GiveUp) and not decision.retryable and "Xid 48" in decision.why
    soft = Failure(K.GPU_FAULT, Stage.FORWARD, {}, "", xid=XidFacts((43,)))
    once = [policy.PastAttempt(knobs, K.GPU_FAULT, 0)]
    assert isinstance(policy.decide(soft, knobs, once, policy.Settings()), policy.Restart)
    twice = once * 2
    assert isinstance(policy.decide(soft, knobs, twice, policy.Settings()), policy.GiveUp)


def test_exit_code_5_is_documented() -> None:
    """The GPU fault exit code has its line in --help."""
    assert SupervisorExitCode.GPU_FAULT == 5 and "\n  5    GPU fault" in EXIT_CODES_HELP


def test_a_fatal_xid_read_through_nvml_stops_the_run_with_exit_5(tmp_path: Path) -> None:
    """NVML seam: Xid 79 arrives while the attempt runs; the run stops (exit 5) and nothing is retried."""
    nvml = FakeNvml()
    clock = FakeClock()
    seams = _seams(clock, {1: "oom@3"})
    spawn = seams.spawn

    def spawn_then_fault(argv: Sequence[str], env: Mapping[str, str], log_path: Path, cwd: Path) -> Any:
        nvml.xids.append(79)  # the driver's event, queued while the child runs
        return spawn(argv, env, log_path, cwd)

    seams.spawn = spawn_then_fault
    seams.open_gpu = lambda device: GpuMonitor.open(device, nvml=nvml)
    assert _run(_job(tmp_path), seams) == SupervisorExitCode.GPU_FAULT
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert len(records) == 1 and records[0].failure is not None
    assert records[0].failure.kind is K.GPU_FAULT and records[0].failure.fatal_xid == 79
    assert records[0].decision is not None and not records[0].decision.retryable
    events = read_events(tmp_path / "run" / "events.jsonl")
    fault = [e for e in events if e["event"] == "gpu_fault"]
    assert fault and fault[0]["xids"] == [79] and fault[0]["fatal"] is True
    assert "fallen off the bus" in fault[0]["meanings"]
