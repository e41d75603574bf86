"""Regex families that name a failure from its text (:func:`find`: the first line that matches).
:func:`refused_before_training`: an import failure, an argument parser's refusal (exit 2) or a
deterministic exception in setup or load, told from stderr alone, fails alike on every start, so
``config_error`` (tried once), not ``other`` (a crash loop)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from qlora_supervise.supervisor.facts.failure import Failure
from qlora_supervise.trainer_child.contract.codes import FailureKind, Stage

_M = re.MULTILINE
_I = re.IGNORECASE
#: The kernel (or a launcher on its behalf) killed the process: SIGKILL after an OOM kill.
HOST_KILLED: tuple[re.Pattern[str], ...] = (
    re.compile(r"Killed\s*$", _M),  # the shell's line; progress bars glue it to their last line
    re.compile(r"\bkilled\s+python", _I),
    re.compile(r"Out of memory: Killed process"),
    re.compile(r"oom-kill(?:er)?\b.*\b(?:python|pid)", _I),
    re.compile(r"exit\s*code\s*[:=]?\s*(?:-9|137)\b", _I),
    re.compile(r"return(?:ed)?\s+(?:code|status)\s*(?:=|:)?\s*(?:-9|137)\b", _I),
    re.compile(r"killed by signal: (?:Killed|SIGKILL)"),
    re.compile(r"Signal 9 \(SIGKILL\) received"),
)
#: No room to write: a full disk, a read-only mount, a quota (errno 28, 30, 122).
DISK_FULL: tuple[re.Pattern[str], ...] = (
    re.compile(r"No space left on device"),
    re.compile(r"Read-only file system"),
    re.compile(r"Disk quota exceeded"),
    re.compile(r"\[Errno (?:28|30|122)\]"),
)
#: NCCL errors and watchdog timeouts.
NCCL: tuple[re.Pattern[str], ...] = (
    re.compile(r"ProcessGroupNCCL.*(?:Watchdog|timeout|timed out)", _I),
    re.compile(r"Watchdog caught collective operation timeout"),
    re.compile(r"\bnccl(?:InternalError|SystemError|UnhandledCudaError|InvalidUsage|RemoteError)\b"),
    re.compile(r"\bNCCL (?:Error \d|error in:|communicator was aborted)"),
    re.compile(r"Distributed package doesn't have NCCL built in"),
)
#: A rank's collective broke because another rank died or stopped answering (gloo, NCCL,
#: torch's store): under torchrun a knock-on effect of the first failure, never its cause.
KNOCK_ON: tuple[re.Pattern[str], ...] = (
    *NCCL,
    re.compile(r"Connection (?:closed|reset) by peer"),
    re.compile(r"\bBroken pipe\b"),
    re.compile(r"gloo/transport/tcp/|\bProcessGroupGloo\b"),
    re.compile(r"\bDistBackendError\b|\bDistNetworkError\b|\bDistStoreError\b"),
    re.compile(r"Timed out waiting|Socket Timeout|recvBytes|sendBytes", _I),
)
#: bitsandbytes cannot load its CUDA library (or only has its CPU build).
BNB_SETUP: tuple[re.Pattern[str], ...] = (
    re.compile(r"CUDA Setup failed", _I),
    re.compile(r"compiled without GPU support"),
    re.compile(r"cadam32bit_grad_fp32"),  # undefined symbol / not found / NoneType has no attribute
    re.compile(r"undefined symbol: cudaRuntimeGetVersion"),
    re.compile(r"libbitsandbytes_cuda\w*\.(?:so|dll).*(?:not found|No such file|cannot open|not exist)", _I),
    re.compile(r"(?:could not|cannot|failed to) (?:find|load)\b.*libbitsandbytes", _I),
)
#: An accelerator ran out of memory: the caching allocator, the driver, cuBLAS / cuDNN.
GPU_OOM: tuple[re.Pattern[str], ...] = (
    # as PyTorch and the drivers print it; a loose "out of memory" in a warning does not count
    re.compile(r"\b(?:CUDA|HIP|XPU|MPS backend) out of memory\b|\berror: out of memory\b|\(out of memory\)"),
    re.compile(r"OutOfMemoryError"),
    re.compile(r"CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED"),
    re.compile(r"cudaErrorMemoryAllocation|hipErrorOutOfMemory"),
    re.compile(r"can NOT allocate memory block with size larger than"),
    re.compile(r"would exceed allowed memory"),
)
#: The host allocator failed inside the process (no kill): PyTorch's CPU allocator, Python.
CPU_OOM: tuple[re.Pattern[str], ...] = (
    re.compile(r"DefaultCPUAllocator: can't allocate memory"),
    re.compile(r"(?<![\w.])MemoryError\b"),  # not the tail of OutOfMemoryError
    re.compile(r"std::bad_alloc"),
)
#: A failure that is not an out-of-memory, recognisable without its exception line.
NOT_OOM: tuple[re.Pattern[str], ...] = (
    re.compile(r"Assertion `.*` failed"),  # device-side assert, printed by the kernel
    re.compile(r"device-side assert|illegal memory access|misaligned address", _I),
    re.compile(r"Segmentation fault|Bus error|Floating point exception|core dumped|Fatal Python error"),
)
#: Where an exception names its class: ``Type: message`` (with rank or log prefixes), a bare
#: ``Type`` line, or a notebook's ``Type    Traceback (most recent call last)`` header.
EXCEPTION_LINE = re.compile(
    r"^[^\S\n]*(?:\[rank\d+\]:\s*|\d+:\s*|[A-Z]+:\s+)?"
    r"(?P<line>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit)\b"
    r"(?:\([\w.]+\))?(?::.*|\s+Traceback \(most recent call last\).*|\s*))$",
    re.MULTILINE,
)


def find(patterns: Sequence[re.Pattern[str]], text: str) -> str | None:
    """The stripped line holding the first match of any of ``patterns``, else None."""
    for pattern in patterns:
        if (match := pattern.search(text)) is not None:
            start, end = text.rfind("\n", 0, match.start()) + 1, text.find("\n", match.end())
            line = " ".join(text[start : end if end >= 0 else len(text)].split())
            return line if len(line) <= 160 else line[:157] + "..."
    return None


_IMPORT_FAILED = re.compile(r"^(?:ModuleNotFoundError|ImportError)\b")
#: Exception classes (by their name's last part) that say the same on every start.
_DETERMINISTIC = frozenset(
    {"ValueError", "TypeError", "KeyError", "AttributeError", "NotImplementedError", "FileNotFoundError"}
    | {"NotADirectoryError", "IsADirectoryError", "SyntaxError", "ValidationError", "SafetensorError"}
    | {"HeaderTooLarge", "OfflineModeIsEnabled"}
)
_EXCEPTION_NAME = re.compile(r"^(?:[A-Za-z_]\w*\.)*(?P<name>[A-Za-z_]\w*)")
_USAGE = re.compile(r"^usage: ", re.MULTILINE)
_PARSER_ERROR = re.compile(r"^(?P<line>[\w.\- ]{1,80}: error: .+)$", re.MULTILINE)
ARGPARSE_EXIT = 2
#: Import errors of an interpreter already shutting down follow the failure that ended it.
_AT_EXIT = re.compile(r"Python is likely shutting down|sys\.meta_path is None|^Exception ignored in", re.M)
#: Stages before the first step (UNKNOWN: no heartbeat and no frame says otherwise).
BEFORE_TRAINING = frozenset({Stage.UNKNOWN, Stage.SETUP, Stage.LOAD})
_PLACED_BEFORE_TRAINING = frozenset({Stage.SETUP, Stage.LOAD})
_NO_GPU = "no GPU here: write use_cpu: true and bf16: false in the tool's config (docs/trainers-cpu.md)"
_DAMAGED = "the model file does not load (damaged or cut short): download the model again"
#: Refusals whose fix is known: (the tool's words, the fix).
FIXES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"You need to assign use_cpu|doesn't support bf16/gpu"), _NO_GPU),
    (re.compile(r"Error while deserializing header|HeaderTooLarge|incomplete metadata"), _DAMAGED),
)


def refused_before_training(
    text: str, stage: Stage, last_stage: Stage, returncode: int | None
) -> Failure | None:
    """The config's failure for ``text`` (a stderr tail judged ``other`` at ``stage``), or None;
    ``last_stage``: the heartbeats' last."""
    if stage not in BEFORE_TRAINING or last_stage not in BEFORE_TRAINING or _AT_EXIT.search(text):
        return None
    lines = [match.group("line").strip() for match in EXCEPTION_LINE.finditer(text)]
    last = lines[-1][:300] if lines else None
    if last is not None and _IMPORT_FAILED.match(last):
        fix = "install the package into the trainer's interpreter, trainer.python"
        return _refusal(stage, "an import failure", last, fix)
    parser = _PARSER_ERROR.findall(text) if returncode == ARGPARSE_EXIT and _USAGE.search(text) else []
    if parser:
        line = parser[-1].strip()[:300]
        return _refusal(stage, "its argument parser's refusal", line, _fix(line))
    placed = stage in _PLACED_BEFORE_TRAINING or last_stage in _PLACED_BEFORE_TRAINING
    named = _EXCEPTION_NAME.match(last) if last is not None else None
    if last is not None and named is not None and placed and named.group("name") in _DETERMINISTIC:
        where = stage if stage is not Stage.UNKNOWN else last_stage
        return _refusal(stage, f"a refusal in {where.value}", last, _fix(last))
    return None


def known_fix(line: str) -> str | None:
    """The fix :data:`FIXES` knows for a refusal's ``line``, or None."""
    return next((fix for pattern, fix in FIXES if pattern.search(line)), None)


def _fix(line: str) -> str:
    return known_fix(line) or "fix the value it names in the tool's config"


def _refusal(stage: Stage, what: str, line: str, fix: str) -> Failure:
    why = f"no error report; stderr ends in {what} {line!r} before step 1: the same on every start ({fix})"
    return Failure(FailureKind.CONFIG_ERROR, stage, {}, why, line)
