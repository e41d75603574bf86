"""GPU faults: NVML Xid events seen while an attempt ran, what they mean, and which are fatal.

A **fatal** Xid (the GPU is broken or must be reset) decides over any other evidence. A non-fatal
one decides only a failure that is not an OOM or config error (Xids are per GPU: another
process's fault can fall in our window), and the attempt is retried once unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qlora_supervise.supervisor.facts.failure import Failure, XidFacts
from qlora_supervise.trainer_child.contract.codes import FailureKind


@dataclass(frozen=True)
class XidMeaning:
    code: int
    meaning: str
    fatal: bool


XIDS: dict[int, XidMeaning] = {
    code: XidMeaning(code, meaning, fatal)
    for code, meaning, fatal in (
        (13, "graphics engine exception (mostly an application error: bad address or instruction)", False),
        (31, "GPU memory page fault (usually an application's illegal memory access)", False),
        (43, "GPU stopped processing (the application's context was reset)", False),
        (45, "preemptive cleanup after earlier errors (the context was killed)", False),
        (48, "double-bit (uncorrectable) ECC error", True),
        (63, "ECC page retirement / row remapping recorded: the GPU needs a reset", True),
        (64, "ECC page retirement / row remapping failed", True),
        (74, "NVLink error", True),
        (79, "GPU has fallen off the bus", True),
        (92, "high single-bit ECC error rate (a warning)", False),
        (94, "contained uncorrectable ECC error", True),
        (95, "uncontained uncorrectable ECC error: every application on the GPU is affected", True),
    )
}

_NOT_OVERRULED = frozenset({FailureKind.CONFIG_ERROR, FailureKind.GPU_FAULT})


def meaning(code: int) -> XidMeaning:
    """The catalogue entry for ``code``; an unknown Xid is not fatal ("see NVIDIA's catalogue")."""
    return XIDS.get(code, XidMeaning(code, "see NVIDIA's Xid catalogue", False))


def describe(codes: Sequence[int]) -> str:
    """``Xid 79 (GPU has fallen off the bus, fatal), Xid 13 (...)``, each code once."""
    parts = []
    for code in dict.fromkeys(codes):
        entry = meaning(code)
        parts.append(f"Xid {code} ({entry.meaning}{', fatal' if entry.fatal else ''})")
    return ", ".join(parts)


def fatal_xid(codes: Sequence[int]) -> int | None:
    """The first fatal Xid among ``codes``, else None."""
    return next((code for code in codes if meaning(code).fatal), None)


def overrule(failure: Failure, codes: Sequence[int]) -> Failure:
    """``failure``, or a ``gpu_fault`` when the Xids seen during the attempt decide (module doc)."""
    if not codes:
        return failure
    fatal = fatal_xid(codes)
    if fatal is None and (failure.kind.is_oom or failure.kind in _NOT_OVERRULED):
        return failure
    facts = XidFacts(tuple(dict.fromkeys(codes)), fatal)
    verdict = "not retried on this GPU" if fatal is not None else "retried once"
    why = (
        f"NVML: {describe(codes)} during the attempt, {verdict}; the child's own failure: {failure.evidence}"
    )
    return Failure(FailureKind.GPU_FAULT, failure.stage, {}, why, failure.message, xid=facts)
