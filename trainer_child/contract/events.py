"""The child's events file: one JSON object per line, the heartbeat and its memory numbers."""

from __future__ import annotations

import dataclasses
import enum
import json
import time
from collections.abc import Mapping
from typing import Any

from qlora_supervise.trainer_child.contract.codes import Stage

EVENT_NAMES = frozenset(
    {
        "started",  # pid, rank, local_rank, world_size, device, versions, trust_remote_code
        "stage",  # stage changed (load, forward, ...)
        "loaded",  # model loaded: trainable params, share, MemoryNumbers, attempt_facts.SampleLengths
        "trainer_ready",  # phases_s (tokenizer, weights, lora, data, trainer); prepared by a spare?
        "heartbeat",  # a Heartbeat: stage, step, loss, tokens_per_s and MemoryNumbers
        "checkpoint_saved",  # step, path, emergency, early (asked for by EARLY_CHECKPOINT_SIGNAL)
        "early_checkpoint_requested",  # step: the signal arrived; a checkpoint follows this step
        "resumed",  # from_step, path, reset_optimizer, reset_reason; RankReduction fields when cut
        "finished",  # step, adapter path
        "stopping",  # graceful stop requested
        "merge_plan",  # the merge's memory plan: device, GPU and host needs, what was free
    }
)


def event_line(event: str, **fields: Any) -> str:
    """One line of the child's events file."""
    return json.dumps({"event": event, "time": time.time(), **fields}, default=str) + "\n"


class PeakSource(str, enum.Enum):
    """What :attr:`MemoryNumbers.peak_bytes` measured: the memory the attempt's cap limits."""

    CUDA_ALLOCATOR = "cuda_allocator"  # torch.cuda.max_memory_allocated on the training GPU
    DATA_SEGMENT = "data_segment"  # peak VmData on the CPU: what RLIMIT_DATA (cpu_memory_limit) caps
    RSS = "rss"  # VmHWM, where the data segment cannot be read


#: Keys of the events files written before :class:`MemoryNumbers` existed, in the precedence
#: order of the peak rule (the same order :meth:`MemoryNumbers.measured` applies).
_OLD_PEAK_KEYS = (
    ("peak", PeakSource.CUDA_ALLOCATOR),
    ("peak_vmdata", PeakSource.DATA_SEGMENT),
    ("peak_rss", PeakSource.RSS),
)


_OLD_GAUGE_KEYS = {
    "allocated": "allocated_bytes",
    "reserved": "reserved_bytes",
    "rss": "rss_bytes",
    "vmdata": "vmdata_bytes",
}


@dataclasses.dataclass(frozen=True)
class MemoryNumbers:
    """The child's memory at one moment, in bytes; None where it could not be read.

    ``peak_bytes`` is the one peak of the attempt so far, chosen once, here, by the child
    (:meth:`measured`); readers take it as it is and never re-derive it from the gauges.
    """

    peak_bytes: int | None = None
    peak_source: PeakSource | None = None
    allocated_bytes: int | None = None  # CUDA allocator, now
    reserved_bytes: int | None = None  # CUDA caching allocator's reserve, now
    rss_bytes: int | None = None  # VmRSS, now
    rss_high_water_bytes: int | None = None  # VmHWM
    vmdata_bytes: int | None = None  # VmData, now

    @classmethod
    def measured(
        cls,
        *,
        cuda_peak: int | None,
        data_segment_peak: int | None,
        rss_high_water: int | None,
        allocated: int | None = None,
        reserved: int | None = None,
        rss: int | None = None,
        vmdata: int | None = None,
    ) -> MemoryNumbers:
        """The peak rule: the CUDA allocator's peak on a GPU, else the data segment's, else VmHWM."""
        peak, source = _first_peak(
            (
                (cuda_peak, PeakSource.CUDA_ALLOCATOR),
                (data_segment_peak, PeakSource.DATA_SEGMENT),
                (rss_high_water, PeakSource.RSS),
            )
        )
        return cls(peak, source, allocated, reserved, rss, rss_high_water, vmdata)

    def fields(self) -> dict[str, Any]:
        """The JSON fields of an event line (flat, so ``jq .peak_bytes`` reads them)."""
        values = dataclasses.asdict(self)
        values["peak_source"] = self.peak_source.value if self.peak_source is not None else None
        return values

    @classmethod
    def from_fields(cls, raw: Mapping[str, Any]) -> MemoryNumbers:
        """Read an event's memory fields; ill-typed values become None.

        Events files written before this record (keys ``peak``, ``peak_vmdata``, ``peak_rss``,
        ``allocated``, ``reserved``, ``rss``, ``vmdata``) are read with the same peak rule.
        """
        if "peak_bytes" in raw:
            source = raw.get("peak_source")
            return cls(
                peak_bytes=_int_or_none(raw.get("peak_bytes")),
                peak_source=PeakSource(source) if source in _PEAK_SOURCES else None,
                **{name: _int_or_none(raw.get(name)) for name in _GAUGE_FIELDS},
            )
        peak, source = _first_peak(tuple((_int_or_none(raw.get(key)), src) for key, src in _OLD_PEAK_KEYS))
        return cls(
            peak_bytes=peak,
            peak_source=source,
            rss_high_water_bytes=_int_or_none(raw.get("peak_rss")),
            **{new: _int_or_none(raw.get(old)) for old, new in _OLD_GAUGE_KEYS.items()},
        )


_PEAK_SOURCES = frozenset(source.value for source in PeakSource)


_GAUGE_FIELDS = ("allocated_bytes", "reserved_bytes", "rss_bytes", "rss_high_water_bytes", "vmdata_bytes")


def _first_peak(
    candidates: tuple[tuple[int | None, PeakSource], ...],
) -> tuple[int | None, PeakSource | None]:
    # `or` semantics of the old reader: a zero peak (nothing allocated yet) falls through too.
    for value, source in candidates:
        if value:
            return value, source
    return None, None


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float_or_none(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """One ``heartbeat`` event: where the child is, how fast it goes, and its memory.

    ``step`` is the last completed optimizer step; the supervisor decides hangs from ``step``
    and ``stage`` not changing, so a beat is sent whatever the main thread does.
    """

    stage: Stage
    step: int
    loss: float | None = None
    tokens_per_s: float | None = None
    memory: MemoryNumbers = MemoryNumbers()

    def fields(self) -> dict[str, Any]:
        """The fields of the event line, flat: ``stage``, ``step``, ``loss``, ``tokens_per_s``
        and those of :meth:`MemoryNumbers.fields`."""
        return {
            "stage": self.stage.value,
            "step": self.step,
            "loss": self.loss,
            "tokens_per_s": self.tokens_per_s,
            **self.memory.fields(),
        }

    def to_line(self) -> str:
        return event_line("heartbeat", **self.fields())

    @classmethod
    def from_fields(cls, raw: Mapping[str, Any]) -> Heartbeat | None:
        """The heartbeat in a parsed event line (today's keys or older ones); None when the
        line has no integer step (not a heartbeat this reader can trust)."""
        step = _int_or_none(raw.get("step"))
        if step is None:
            return None
        return cls(
            stage=Stage.named(raw.get("stage")),
            step=step,
            loss=_float_or_none(raw.get("loss")),
            tokens_per_s=_float_or_none(raw.get("tokens_per_s")),
            memory=MemoryNumbers.from_fields(raw),
        )
