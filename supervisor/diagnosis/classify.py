"""Classify a failure: pure functions from evidence to a :class:`Failure`.
``classify_exit`` (our child) reads the sources strongest first; the first that decides wins:
0. a GPU fault (:mod:`.xid`): a fatal Xid decides; a non-fatal one all but an OOM or config error;
1. we killed it: a hung child -> ``hang`` at the heartbeats' last stage;
2. the error report: config error, damaged checkpoint, disk full, bitsandbytes / NCCL text; an OOM is
   contention, else fragmentation, else the stage's OOM kind, maybe marked spurious; else ``other``;
3. exit status + cgroup: SIGKILL with an ``oom_kill`` increment or ``Killed`` in stderr -> ``host_oom``
   (with neither: ``other``); the reserved exit codes -> their kinds;
4. stderr text (:func:`classify_text`); a refusal before any training stage -> ``config_error``;
5. nothing: ``other`` (``ExitCode.OOM`` alone: ``oom_forward``, the commonest site).
``classify_text`` follows the failure corpus's labelling order: host kill -> NCCL -> bitsandbytes
setup -> disk full -> accelerator OOM (stage from :mod:`._frames`) -> host allocator (``host_oom``
without stage frames) -> ``other``. A traceback cut before its exception line, with no non-OOM sign,
is *presumed* an OOM of the stage its frames name: a missed OOM costs more than a needless rung.
:func:`first_failure`: which of several ranks' reports is the cause, which are knock-on effects."""

from __future__ import annotations

import dataclasses
import re
import signal as signals
from collections.abc import Mapping, Sequence
from typing import Any

from qlora_supervise.supervisor.diagnosis import _oom_rules, _signatures, fragmentation, xid
from qlora_supervise.supervisor.diagnosis._frames import StageFinding, parse_frames, stage_from_frames
from qlora_supervise.supervisor.diagnosis.advice import batch_numbers
from qlora_supervise.supervisor.diagnosis.fragmentation import StepFit
from qlora_supervise.supervisor.facts.failure import ChildExit, Failure, KilledBy
from qlora_supervise.trainer_child.contract.allocator import AllocatorFacts
from qlora_supervise.trainer_child.contract.codes import OOM_KIND_BY_STAGE, ExitCode, FailureKind, Stage
from qlora_supervise.trainer_child.contract.oom_message import parse_messages, parse_numbers
from qlora_supervise.trainer_child.contract.report import ErrorReport

_SIGKILL_CODES = frozenset({-signals.SIGKILL, 128 + signals.SIGKILL})
TEXT_WINDOW = 1 << 20  # characters of a log that classify_text reads, from the end
# A traceback cut before its exception line, in one of these stages, is presumed an OOM.
_PRESUMED_OOM_STAGES = frozenset(
    {Stage.LOAD, Stage.RESUME, Stage.FORWARD, Stage.BACKWARD, Stage.OPTIMIZER, Stage.EVAL, Stage.MERGE}
)
_SIGNATURE_FAMILIES = (
    (FailureKind.HOST_OOM, _signatures.HOST_KILLED, "kill line"),
    (FailureKind.NCCL, _signatures.NCCL, "NCCL error"),
    (FailureKind.BNB_CUDA_SETUP, _signatures.BNB_SETUP, "bitsandbytes setup error"),
)
# An exit status without a report that names its kind by itself.
_NO_CHECKPOINT = "exit code CHECKPOINT (74) without a report: the resume checkpoint did not load"
_NO_ROOM = "exit code DISK_FULL (76) without a report (no room for it either)"
_EXIT_CODE_KINDS: dict[int | None, tuple[FailureKind, Stage, str]] = {
    ExitCode.CONFIG: (FailureKind.CONFIG_ERROR, Stage.UNKNOWN, "exit code CONFIG (71) without a report"),
    ExitCode.CHECKPOINT: (FailureKind.CHECKPOINT_DAMAGED, Stage.UNKNOWN, _NO_CHECKPOINT),
    ExitCode.DISK_FULL: (FailureKind.DISK_FULL, Stage.SAVE, _NO_ROOM),
}


def classify_text(text: str) -> Failure:
    """Classify any command's log from its last :data:`TEXT_WINDOW` characters alone: the failure is
    at the end, and an earlier recovered error misleads."""
    text = _window(text)
    stage = stage_from_frames(parse_frames(text), text)
    numbers = _oom_rules.derive(parse_numbers(text))
    for kind, patterns, what in _SIGNATURE_FAMILIES:
        line = _signatures.find(patterns, text)
        if line is not None:  # bitsandbytes loads its library at import: setup, where no frame says
            bnb_setup = kind is FailureKind.BNB_CUDA_SETUP and stage.stage is Stage.UNKNOWN
            where, what = (Stage.SETUP if bnb_setup else stage.stage), f"{what} {line!r}"
            return Failure(kind, where, numbers, f"text: {what}; stage {where.value} from {stage.why}", what)
    if (disk_line := _signatures.find(_signatures.DISK_FULL, text)) is not None:
        why = f"text: no room to write {disk_line!r}; stage {stage.stage.value} from {stage.why}"
        return Failure(FailureKind.DISK_FULL, stage.stage, {}, why, disk_line)
    if (oom_line := _signatures.find(_signatures.GPU_OOM, text)) is not None:
        return oom_failure(stage, numbers, _oom_source(text, oom_line), message=oom_line)
    if (cpu_line := _signatures.find(_signatures.CPU_OOM, text)) is not None and stage.stage is Stage.UNKNOWN:
        why = f"text: host allocation failed {cpu_line!r}; no frame names a stage"
        return Failure(FailureKind.HOST_OOM, Stage.UNKNOWN, numbers, why, cpu_line)
    if cpu_line is not None:
        why = f"text: host allocation failed {cpu_line!r}; {_stage_why(stage)}"
        return Failure(_stage_kind(stage.stage), stage.stage, numbers, why, cpu_line)
    return _other_from_text(text, stage)


def _window(text: str) -> str:
    if len(text) <= TEXT_WINDOW:
        return text
    cut = text.find("\n", len(text) - TEXT_WINDOW)
    return text[cut + 1 :] if cut >= 0 else text[-TEXT_WINDOW:]


def classify_exit(
    exit: ChildExit,
    report: ErrorReport | None,
    stderr_tail: str,
    cgroup_oom_kills: int = 0,
    gpu_others_bytes: int | None = None,
    gpu_total_bytes: int | None = None,
    last_stage: Stage = Stage.UNKNOWN,
    last_step: int | None = None,
    fit: StepFit | None = None,
    xid_events: Sequence[int] = (),
) -> Failure:
    """Classify how our child ended (module docstring). ``last_stage`` / ``last_step``: the heartbeats'
    last (a hung child writes no report); ``fit``: the model's peak against the budget;
    ``xid_events``: the NVML Xids seen while the attempt ran."""
    nvml = (gpu_others_bytes, gpu_total_bytes)
    found: Failure | None = None
    if exit.killed_by_supervisor is KilledBy.HANG:
        after = f" after step {last_step}" if last_step is not None else ""
        why = f"supervisor: no progress before the timeout; last seen in {last_stage.value}{after}"
        found = Failure(FailureKind.HANG, last_stage, {}, why)
    elif report is not None:
        found = _from_report(report, nvml, fit)
    else:
        found = _from_exit_status(exit, stderr_tail, cgroup_oom_kills, last_stage)
    if found is None and exit.killed_by_supervisor is not None:
        why = f"supervisor stopped the child ({exit.killed_by_supervisor.value}); no error report"
        found = Failure(FailureKind.OTHER, Stage.UNKNOWN, {}, why)
    if found is None:
        text = classify_text(stderr_tail)
        # The heartbeats saw no step, eval or save begin, and the text says only ``other`` (an OOM,
        # a CUDA error or any other sign decides).
        if last_stage in _signatures.BEFORE_TRAINING and text.kind is FailureKind.OTHER:
            window = _window(stderr_tail)
            found = _signatures.refused_before_training(window, text.stage, last_stage, exit.returncode)
        found = found or _from_stderr(exit, text, nvml)
    return xid.overrule(found, xid_events)


def oom_failure(
    stage: StageFinding,
    numbers: Mapping[str, Any],
    source: str,
    message: str = "",
    nvml: tuple[int | None, int | None] = (None, None),
    allocator: AllocatorFacts | None = None,
    fit: StepFit | None = None,
) -> Failure:
    """An accelerator OOM: contention, then fragmentation, then the stage's OOM kind; any but
    contention is marked spurious where the allocator's numbers say the request fit."""
    where = f"stage {stage.stage.value} from {stage.why}"
    if (reason := _oom_rules.contention(numbers, *nvml)) is not None:
        why = f"{source}; contention: {reason}; {where}"
        return Failure(FailureKind.OOM_CONTENTION, stage.stage, numbers, why, message)
    verdict = fragmentation.judge(allocator, numbers, fit)
    if verdict is not None:  # the allocator's facts or the model's prediction decide
        numbers = {**numbers, **verdict.numbers}
        reason = verdict.why if verdict.fragmentation else None
        capacity = f"{source}; {verdict.why}; {_stage_why(stage)}"
    else:
        reason = _oom_rules.fragmentation(numbers)
        capacity = f"{source}; {_stage_why(stage)}"
    if reason is not None:
        why = f"{source}; fragmentation: {reason}; {where}"
        found = Failure(FailureKind.OOM_FRAGMENTATION, stage.stage, numbers, why, message)
    else:
        found = Failure(_stage_kind(stage.stage), stage.stage, numbers, capacity, message)
    return fragmentation.mark_spurious(found, allocator)


def _oom_source(text: str, line: str) -> str:
    if not (messages := [m for m in parse_messages(text) if m.device != "cpu"]):
        return f"text: {line[:80]!r}"
    first = messages[0]
    more = f" (+{len(messages) - 1} more)" if len(messages) > 1 else ""
    return f"text: {first.device.upper()} allocator OOM message, {first.format} wording{more}"


def _stage_kind(stage: Stage) -> FailureKind:
    return OOM_KIND_BY_STAGE.get(stage, FailureKind.OOM_FORWARD)


def _stage_why(stage: StageFinding) -> str:
    if stage.stage is Stage.UNKNOWN:
        return f"{stage.why}: oom_forward, the commonest site"
    return f"stage {stage.stage.value} from {stage.why}"


def _other_from_text(text: str, stage: StageFinding) -> Failure:
    lines = [match.group("line").strip() for match in _signatures.EXCEPTION_LINE.finditer(text)]
    known = _signatures.find(_signatures.NOT_OOM, text)
    if lines or known:
        line = (known or lines[-1])[:160]
        why = f"text: not an out-of-memory error {line!r}; stage {stage.stage.value} from {stage.why}"
        return Failure(FailureKind.OTHER, stage.stage, {}, why, line)
    if stage.stage in _PRESUMED_OOM_STAGES:
        why = f"text: traceback cut before its exception line, presumed OOM; {_stage_why(stage)}"
        return Failure(_stage_kind(stage.stage), stage.stage, {}, why)
    why = f"text: no exception line and no frame names a stage ({stage.why})"
    return Failure(FailureKind.OTHER, stage.stage, {}, why)


def _from_report(report: ErrorReport, nvml: tuple[int | None, int | None], fit: StepFit | None) -> Failure:
    stage = report.stage  # a Stage already: an unknown name reads back as Stage.UNKNOWN
    text = f"{report.exception_type}: {report.message}\n{report.traceback}"
    head = f"error report: {report.exception_type} in {stage.value} at step {report.step}"
    message = f"{report.exception_type}: {report.message}"[:300]
    # A bitsandbytes library that does not load is raised as an import or attribute error while
    # loading, which the child marks the config's: its own kind (not retryable either) says more.
    if report.config_error and _signatures.find(_signatures.BNB_SETUP, text) is None:
        fix = _signatures.known_fix(message)
        why = f"{head}; marked config_error" + (f" ({fix})" if fix else "")
        return Failure(FailureKind.CONFIG_ERROR, stage, {}, why, message)
    if report.damaged_checkpoint and not report.is_oom:
        why = f"{head}; the checkpoint {report.damaged_checkpoint} did not load"
        return Failure(FailureKind.CHECKPOINT_DAMAGED, stage, {}, why, message)
    if report.disk_full:
        facts = report.disk or {}
        disk = {key: facts[key] for key in ("needed_bytes", "free_bytes") if isinstance(facts.get(key), int)}
        return Failure(FailureKind.DISK_FULL, stage, disk, f"{head}; no room on the disk", message)
    for kind, patterns, what in _SIGNATURE_FAMILIES[1:]:
        if (line := _signatures.find(patterns, text)) is not None and not report.is_oom:
            return Failure(kind, stage, {}, f"{head}; {what} {line!r}", message)
    if not report.is_oom and not _signatures.find(_signatures.GPU_OOM + _signatures.CPU_OOM, message):
        return Failure(FailureKind.OTHER, stage, {}, f"{head}; not an out-of-memory error", message)
    # The report's numbers, typed when it was read; an older child's report may have none.
    numbers = _oom_rules.derive(report.oom_numbers.to_json() or parse_numbers(report.message))
    finding = StageFinding(stage, "the error report")
    found = oom_failure(finding, numbers, head, message, nvml, report.allocator, fit)
    if report.batch is not None:  # the micro-batch it happened on (a repeat is told by the loop)
        found = dataclasses.replace(found, numbers={**found.numbers, **batch_numbers(report.batch)})
    if found.kind is FailureKind.OOM_FRAGMENTATION and report.expandable_segments_active:
        # The fix fragmentation names was in place and the step still did not fit: capacity.
        why = f"{found.evidence}; but expandable_segments was already active: capacity"
        return dataclasses.replace(found, kind=_stage_kind(stage), evidence=why)
    return found


def _from_exit_status(
    exit: ChildExit, stderr_tail: str, cgroup_oom_kills: int, last_stage: Stage
) -> Failure | None:
    sigkill = exit.signal == signals.SIGKILL or exit.returncode in _SIGKILL_CODES
    status = f"signal {exit.signal}" if exit.signal else f"exit code {exit.returncode}"
    if cgroup_oom_kills > 0 and (sigkill or exit.returncode != 0):
        stage, where = _killed_stage(stderr_tail, last_stage)
        why = f"{status}; cgroup memory.events oom_kill +{cgroup_oom_kills}{where}"
        return Failure(FailureKind.HOST_OOM, stage, {}, why)
    if sigkill:
        if (killed := _signatures.find(_signatures.HOST_KILLED, stderr_tail)) is not None:
            stage, where = _killed_stage(stderr_tail, last_stage)
            why = f"{status}; no cgroup evidence but stderr says {killed!r}{where}"
            return Failure(FailureKind.HOST_OOM, stage, {}, why)
        why = f"{status} without OOM-kill evidence (no cgroup oom_kill, no 'Killed' line)"
        return Failure(FailureKind.OTHER, _stderr_stage(stderr_tail), {}, why)
    named = _EXIT_CODE_KINDS.get(exit.returncode)
    return None if named is None else Failure(named[0], named[1], {}, named[2])


def _killed_stage(stderr_tail: str, last_stage: Stage) -> tuple[Stage, str]:
    """The stage of a child the kernel killed and where that came from: frames are rare after a
    SIGKILL, the last heartbeat is not (an optimizer kill must not walk the forward ladder)."""
    from_frames = _stderr_stage(stderr_tail)
    if from_frames is not Stage.UNKNOWN:
        return from_frames, f"; stage {from_frames.value} from stderr frames"
    if last_stage is not Stage.UNKNOWN:
        return last_stage, f"; stage {last_stage.value} from the last heartbeat"
    return Stage.UNKNOWN, ""


def _stderr_stage(stderr_tail: str) -> Stage:
    return stage_from_frames(parse_frames(stderr_tail), stderr_tail).stage


def _from_stderr(exit: ChildExit, text: Failure, nvml: tuple[int | None, int | None]) -> Failure:
    """``text``: the stderr tail's :func:`classify_text` verdict."""
    if text.kind.is_oom and text.kind is not FailureKind.HOST_OOM and nvml[0] is not None:
        stage = StageFinding(text.stage, "stderr frames")
        text = oom_failure(stage, text.numbers, "stderr", text.message, nvml)
    if text.kind is not FailureKind.OTHER or text.message:
        why = f"no error report; stderr {text.evidence}"
        return Failure(text.kind, text.stage, text.numbers, why, text.message)
    if exit.returncode == ExitCode.OOM:
        why = "exit code OOM (70) without a report or message; stage unknown: oom_forward"
        return Failure(FailureKind.OOM_FORWARD, text.stage, {}, why)
    why = f"exit code {exit.returncode}; nothing in stderr decides"
    return Failure(FailureKind.OTHER, text.stage, {}, why)


@dataclasses.dataclass(frozen=True)
class RankCause:
    """The report that decides an attempt of several ranks, and the ranks that only followed it."""

    report: ErrorReport
    knock_on: tuple[int, ...]  # ranks whose reports were effects of the cause (sorted)
    why: str  # in words, for the evidence: "rank 1 (local rank 1) of 2 failed first; ..."


def is_knock_on(report: ErrorReport) -> bool:
    """A report of a rank that failed *because another one did*: a broken collective (not an OOM
    of its own), or a stop torchrun asked for."""
    if report.exit_code == ExitCode.STOPPED:
        return True
    if report.is_oom or report.config_error or report.disk_full:
        return False
    text = f"{report.exception_type}: {report.message}\n{report.traceback}"
    return _signatures.find(_signatures.KNOCK_ON, text) is not None


def first_failure(reports: Sequence[ErrorReport]) -> RankCause | None:
    """The cause among the ranks' reports (ties: the lower rank); None when none failed. When all are
    knock-on effects, the rank that failed first left none: the earliest stands for it, ``why`` says so."""
    if not (failed := [r for r in reports if r.exit_code not in (ExitCode.OK, ExitCode.STOPPED)]):
        return None
    real = [r for r in failed if not is_knock_on(r)]
    cause = min(real or failed, key=lambda r: (r.time, r.rank))
    others = tuple(sorted(r.rank for r in reports if r is not cause))
    where = f"rank {cause.rank} (local rank {cause.local_rank}) of {cause.world_size}"
    if not real:
        why = f"{where} failed first, with a broken collective only: the rank that died first left no report"
    elif others:
        why = f"{where} failed first; rank(s) {', '.join(map(str, others))} followed (knock-on)"
    else:
        why = f"{where} failed"
    return RankCause(cause, others if real else (), why)


#: torchrun's summary of a failed run: the rank under "Root Cause (first observed failure)".
_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):\s*\[\d+\]:.*?rank\s*:\s*(\d+)", re.DOTALL)


def torchrun_root_rank(log_tail: str) -> int | None:
    """The rank torchrun saw fail first, from its summary in the child's log (when no report says)."""
    found = _ROOT_CAUSE.findall(log_tail)
    return int(found[-1]) if found else None
