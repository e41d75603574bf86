"""Reserved exit codes, the child's stages and the failure kinds both processes name."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Annotated

from pydantic import BeforeValidator


class ExitCode(enum.IntEnum):
    """Reserved exit codes of the trainer child (gunicorn-style: they stop restart loops)."""

    OK = 0
    OOM = 70  # memory ran out; the error report says where and with which numbers
    CONFIG = 71  # bad job, model, data or target_modules: never retried
    FAILED = 72  # any other exception; the report has the traceback
    STOPPED = 73  # asked to stop (SIGTERM), checkpointed first: resumable
    CHECKPOINT = 74  # the checkpoint to resume from cannot be loaded; the report names it
    DISK_FULL = 76  # no room (or a read-only file system) for a checkpoint or the report


class Stage(str, enum.Enum):
    """Where the child was when it failed. Set by the child, read by the classifier."""

    SETUP = "setup"
    LOAD = "load"
    RESUME = "resume"  # the resume checkpoint's state loaded before the first resumed step
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    EVAL = "eval"
    SAVE = "save"
    MERGE = "merge"
    UNKNOWN = "unknown"

    @classmethod
    def named(cls, value: object) -> Stage:
        """The stage a file names; anything unknown (a newer child, a torn value) is UNKNOWN."""
        try:
            return cls(value)
        except ValueError:
            return cls.UNKNOWN


#: A stage as a file names it (unknown names read as UNKNOWN).
StageName = Annotated[Stage, BeforeValidator(Stage.named)]


class FailureKind(str, enum.Enum):
    """The failure kinds of ARCHITECTURE.md."""

    OOM_LOAD = "oom_load"
    OOM_FORWARD = "oom_forward"
    OOM_BACKWARD = "oom_backward"
    OOM_OPTIMIZER = "oom_optimizer"
    OOM_EVAL = "oom_eval"
    OOM_MERGE = "oom_merge"
    OOM_RESUME = "oom_resume"
    OOM_FRAGMENTATION = "oom_fragmentation"
    OOM_CONTENTION = "oom_contention"
    HOST_OOM = "host_oom"
    HANG = "hang"
    BNB_CUDA_SETUP = "bnb_cuda_setup"
    NCCL = "nccl"
    CONFIG_ERROR = "config_error"
    CHECKPOINT_DAMAGED = "checkpoint_damaged"  # the resume checkpoint would not load: quarantine it
    DISK_FULL = "disk_full"  # ENOSPC / EROFS / EDQUOT writing a checkpoint, a report or the journal
    GPU_FAULT = "gpu_fault"  # an NVML Xid event during the attempt (supervisor/diagnosis/xid.py)
    OTHER = "other"

    @property
    def is_oom(self) -> bool:
        return self.value.startswith("oom_") or self is FailureKind.HOST_OOM


#: The stage-named OOM kind (``oom_<stage>``) for each stage. Setup counts as load; a checkpoint save
#: happens between steps with the whole training state resident, so it takes the backward ladder.
_OOM_STAGE = {Stage.SETUP: Stage.LOAD, Stage.SAVE: Stage.BACKWARD}
OOM_KIND_BY_STAGE: Mapping[Stage, FailureKind] = {
    stage: FailureKind(f"oom_{_OOM_STAGE.get(stage, stage).value}")
    for stage in Stage
    if stage is not Stage.UNKNOWN
}
