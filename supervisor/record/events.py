"""The one vocabulary of event names in ``events.jsonl``: people grep for them and tools select on them, so a
name never changes meaning. The README lists every member; a test holds the two together."""

from __future__ import annotations

import enum


class Event(str, enum.Enum):
    """Every event the supervisor writes, grouped by the part of the run it belongs to."""

    # the run
    RUN_STARTED = "run_started"
    RUN_RESUMED = "run_resumed"
    RUN_SUCCEEDED = "run_succeeded"
    RUN_ALREADY_ENDED = "run_already_ended"
    GAVE_UP = "gave_up"
    STOPPED = "stopped"
    JOB_CHANGED = "job_changed"
    PREFLIGHT = "preflight"
    NOTHING_FITS = "nothing_fits"  # no config is predicted to fit: the run stops before a child starts
    GENERATION_STARTED = "generation_started"
    VERDICT_LIFTED = "verdict_lifted"
    # one attempt
    ATTEMPT_STARTED = "attempt_started"
    ATTEMPT_SUCCEEDED = "attempt_succeeded"
    ATTEMPT_INTERRUPTED = "attempt_interrupted"
    CHILD_EXITED = "child_exited"
    HANG_DETECTED = "hang_detected"
    STOP_REQUESTED = "stop_requested"
    CHECKPOINTS_SKIPPED = "checkpoints_skipped"
    CHECKPOINTS_SUPERSEDED = "checkpoints_superseded"
    RANK_REDUCED = "rank_reduced"
    UNRECORDED_ATTEMPT_MOVED = "unrecorded_attempt_moved"
    ORPHAN_CHILD_STOPPING = "orphan_child_stopping"
    CHECKPOINT_QUARANTINED = "checkpoint_quarantined"
    OPTIMIZER_RESET = "optimizer_reset"
    TRUST_REMOTE_CODE = "trust_remote_code"
    JOB_ADVICE = "job_advice"  # a warning of validate's (jobfile/advice.py), said again at run start
    MEMORY_CREEP = "memory_creep"
    FIRST_STEP = "first_step"
    # a rung's cause cleared (policies/ladder/step_up.py): the planned restart to a faster config,
    # or why not; the card's sharing changed since the speed trial: the trial is timed again
    STEP_UP = "step_up"
    STEP_UP_REFUSED = "step_up_refused"
    RETIME = "retime"
    # A foreign trainer's child wrote none of our events: classified from its stderr alone.
    SHIM_NOT_ATTACHED = "shim_not_attached"
    # the warm spare (loop/spare.py)
    SPARE_OFF = "spare_off"
    SPARE_STARTED = "spare_started"
    SPARE_SKIPPED = "spare_skipped"
    SPARE_USED = "spare_used"
    SPARE_DISCARDED = "spare_discarded"
    RANK_PEAKS_UNEVEN = "rank_peaks_uneven"  # torchrun: one rank's peak well above the others'
    RANK_PARTS_SEALED = "rank_parts_sealed"  # torchrun: every rank's emergency part of one step
    RANK_PARTS_UNTRUSTED = "rank_parts_untrusted"  # torchrun: parts missing or of different steps
    RANKS_SHUTDOWN_BOUNDED = "ranks_shutdown_bounded"  # torchrun: ranks left after a failure, stopped
    # after a failure
    FAILURE_CLASSIFIED = "failure_classified"
    RETRY = "retry"
    BACKOFF = "backoff"
    WAITING_FOR_MEMORY = "waiting_for_memory"
    MEMORY_AVAILABLE = "memory_available"
    MEMORY_WAIT_TIMED_OUT = "memory_wait_timed_out"
    NO_MEMORY_READING = "no_memory_reading"
    WAITING_FOR_DISK = "waiting_for_disk"
    DISK_ROOM_AVAILABLE = "disk_room_available"
    DISK_WAIT_TIMED_OUT = "disk_wait_timed_out"
    STAGING_FREED = "staging_freed"
    GPU_FAULT = "gpu_fault"
    # the supervisor itself
    GPU_MONITOR_UNAVAILABLE = "gpu_monitor_unavailable"
    SIGHUP_IGNORED = "sighup_ignored"
    STATE_UNREADABLE = "state_unreadable"
    JOURNAL_LINE_UNREADABLE = "journal_line_unreadable"
    REPORT_UNREADABLE = "report_unreadable"
    SUPERVISOR_DISK_FULL = "supervisor_disk_full"
    HOOK_FAILED = "hook_failed"  # supervise.on_event failed or timed out; the run goes on
    OUTPUT_FAILED = "output_failed"  # an optional output (metrics textfile, sd_notify) failed; logged once
    OUTPUT_RECOVERED = "output_recovered"  # that output works again

    def __str__(self) -> str:
        return self.value
