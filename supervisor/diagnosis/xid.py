"""GPU faults: NVML Xid events seen while an attempt ran, what they mean, and which are fatal.
A **fatal** Xid (the GPU is broken or must be reset) decides over any other evidence. A non-fatal
one decides only a failure that is not an OOM or config error (Xids are per GPU: another
process's fault can fall in our window), and the attempt is retried once unchanged."""

from __future__ import annotations

from collections.abc import Sequence

from qlora_supervise.supervisor.facts.failure import Failure, XidFacts
from qlora_supervise.trainer_child.contract.codes import FailureKind

#: What each Xid means (NVIDIA's catalogue); an unknown one is not fatal.
XIDS: dict[int, str] = {
    13: "graphics engine exception (mostly an application error: bad address or instruction)",
    31: "GPU memory page fault (usually an application's illegal memory access)",
    43: "GPU stopped processing (the application's context was reset)",
    45: "preemptive cleanup after earlier errors (the context was killed)",
    48: "double-bit (uncorrectable) ECC error",
    63: "ECC page retirement / row remapping recorded: the GPU needs a reset",
    64: "ECC page retirement / row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate (a warning)",
    94: "contained uncorrectable ECC error",
    95: "uncontained uncorrectable ECC error: every application on the GPU is affected",
}
#: The GPU is broken or must be reset.
FATAL_XIDS = frozenset({48, 63, 64, 74, 79, 94, 95})
_UNKNOWN = "see NVIDIA's Xid catalogue"
_NOT_OVERRULED = frozenset({FailureKind.CONFIG_ERROR, FailureKind.GPU_FAULT})


def describe(codes: Sequence[int]) -> str:
    """``Xid 79 (GPU has fallen off the bus, fatal), Xid 13 (...)``, each code once."""
    fatal = {code: ", fatal" if code in FATAL_XIDS else "" for code in codes}
    return ", ".join(f"Xid {code} ({XIDS.get(code, _UNKNOWN)}{fatal[code]})" for code in fatal)


def fatal_xid(codes: Sequence[int]) -> int | None:
    """The first fatal Xid among ``codes``, else None."""
    return next((code for code in codes if code in FATAL_XIDS), None)


def overrule(failure: Failure, codes: Sequence[int]) -> Failure:
    """``failure``, or a ``gpu_fault`` when the Xids seen during the attempt decide (module doc)."""
    if not codes:
        return failure
    if (fatal := fatal_xid(codes)) is None and (failure.kind.is_oom or failure.kind in _NOT_OVERRULED):
        return failure
    facts = XidFacts(tuple(dict.fromkeys(codes)), fatal)
    verdict = "not retried on this GPU" if fatal is not None else "retried once"
    xids = describe(codes)
    why = f"NVML: {xids} during the attempt, {verdict}; the child's own failure: {failure.evidence}"
    return Failure(FailureKind.GPU_FAULT, failure.stage, {}, why, failure.message, xid=facts)
