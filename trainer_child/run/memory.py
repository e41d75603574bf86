"""Memory caps, measurements and allocator settings of the trainer child (torch imported inside the
functions: :func:`prepare_process_env` runs before it is)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import gc
import os
import resource
from pathlib import Path
from typing import Any

from qlora_supervise.trainer_child.contract import allocator, events, spec
from qlora_supervise.trainer_child.run.failure import ConfigError, is_oom, oom_numbers

_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 1 << 20
#: Injected fault for tests: ``cpu_memory_limit`` applies only after this optimizer step (late OOM).
TEST_CAP_AFTER_STEP = "QLORA_SUPERVISE_TEST_CAP_AFTER_STEP"
#: Injected fault for the step-up bench (``N:S``): after optimizer step N (only) the child hands its
#: cached GPU memory back and pauses S seconds, so a neighbour can take the card.
TEST_YIELD_GPU_AT_STEP = "QLORA_SUPERVISE_TEST_YIELD_GPU_AT_STEP"


class MemoryCapError(ConfigError):
    """A cap that cannot work (below what the process already uses)."""


def prepare_process_env(expandable_segments: bool) -> None:
    """Fix allocator settings before ``import torch`` (as the supervisor does, for a child run by hand)."""
    os.environ.update(allocator.allocator_env(os.environ, expandable_segments))
    # Arrow's jemalloc/mimalloc pool reserves ~1 GiB of address space, counted by RLIMIT_DATA unused.
    os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
    tune_malloc()


def tune_malloc(arenas: int = 2) -> None:
    """Keep the data segment (what RLIMIT_DATA counts) close to live memory: few arenas (64 MiB of
    address space each), and a fixed mmap threshold (glibc raises it after the first large free, and
    the heap never shrinks: after an OOM the emergency checkpoint could not allocate)."""
    if (path := ctypes.util.find_library("c")) is None:
        return
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to tune
        libc = ctypes.CDLL(path)
        libc.mallopt(_M_ARENA_MAX, arenas)
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def proc_status_bytes(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status (VmData, VmRSS, VmHWM) in bytes; None off Linux."""
    with contextlib.suppress(OSError), open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


def reset_host_peak() -> bool:
    """Restart the RSS high-water mark (VmHWM) from the RSS now; False where it cannot."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")
        return True
    return False


def peak_vmdata() -> int | None:
    """Peak of the data segment: VmPeak less the non-data mappings (fixed once the model is loaded)."""
    peak, size, data = (proc_status_bytes(f) for f in ("VmPeak", "VmSize", "VmData"))
    if peak is None or size is None or data is None:
        return None
    return peak - size + data


def apply_cpu_cap(limit: int | None) -> None:
    """Cap the data segment with RLIMIT_DATA (the soft limit, so the report can lift it); after the
    imports (a fixed cost), before the load (what the knobs control)."""
    if limit is None:
        return
    used = proc_status_bytes("VmData") or 0
    if limit <= used:
        raise MemoryCapError(
            f"cpu_memory_limit {limit} bytes is below the child's data segment after imports "
            f"({used} bytes, VmData): raise the limit above {used} bytes plus the model and activations"
        )
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    soft = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def late_cap_step() -> int | None:
    value = os.environ.get(TEST_CAP_AFTER_STEP, "")
    return int(value) if value.isdigit() else None


def gpu_yield() -> tuple[int, float] | None:
    step, _, seconds = os.environ.get(TEST_YIELD_GPU_AT_STEP, "").partition(":")
    return (int(step), float(seconds or 0)) if step.isdigit() else None


def lift_cpu_cap() -> None:
    with contextlib.suppress(ValueError, OSError):
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))


def apply_gpu_cap(limit: int | None) -> None:
    import torch

    if limit is None or not torch.cuda.is_available():
        return
    index = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    if limit <= 0 or limit > total:
        raise MemoryCapError(f"gpu_memory_limit {limit} bytes is outside (0, {total}] of the device")
    torch.cuda.set_per_process_memory_fraction(limit / total, index)


def expandable_segments_active() -> bool | None:
    """Whether the CUDA allocator truly uses expandable segments (not if set late or misspelt); CPU: None."""
    import torch

    if not torch.cuda.is_available():
        return None
    probe = torch.empty(1, device="cuda")
    try:
        flags = [seg["is_expandable"] for seg in torch.cuda.memory_snapshot() if "is_expandable" in seg]
        if flags:
            return all(flags)
    finally:
        del probe
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    return None if getter is None else "expandable_segments:true" in getter().replace(" ", "").lower()


def memory_numbers() -> events.MemoryNumbers:
    import torch

    on_cuda = torch.cuda.is_available()
    return events.MemoryNumbers.measured(
        cuda_peak=torch.cuda.max_memory_allocated() if on_cuda else None,
        data_segment_peak=peak_vmdata(),
        rss_high_water=proc_status_bytes("VmHWM"),
        allocated=torch.cuda.memory_allocated() if on_cuda else None,
        reserved=torch.cuda.memory_reserved() if on_cuda else None,
        rss=proc_status_bytes("VmRSS"),
        vmdata=proc_status_bytes("VmData"),
    )


def cuda_memory_stats() -> dict[str, Any] | None:
    import torch

    with contextlib.suppress(RuntimeError):
        return dict(torch.cuda.memory_stats()) if torch.cuda.is_available() else None
    return None


def free_memory() -> None:
    """Give back what the allocators hold (gc first: frames hold tensors)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def start_memory_history(diagnose: spec.DiagnoseSpec) -> bool:
    """Record the CUDA allocator's history if ``diagnose`` asks (a ring, Python stacks: C++ is far dearer)."""
    import torch

    if not diagnose.memory_history or not torch.cuda.is_available():
        return False
    with contextlib.suppress(RuntimeError, TypeError, AttributeError):
        torch.cuda.memory._record_memory_history(max_entries=diagnose.memory_history_entries, stacks="python")
        return True
    return False


def dump_memory_snapshot(path: Path) -> str | None:
    """Write the recorded history to ``path`` (for https://pytorch.org/memory_viz); None on failure."""
    import torch

    with contextlib.suppress(RuntimeError, OSError, AttributeError, MemoryError):
        torch.cuda.memory._dump_snapshot(str(path))  # type: ignore[no-untyped-call]  # untyped in torch
        return str(path)
    return None


def allocator_facts_at_oom(
    exc: BaseException, limit: int | None, shapes: StepShapes | None
) -> allocator.AllocatorFacts | None:
    """The CUDA allocator's facts of an OOM, read before the step's tensors go (None: CPU, not OOM, error)."""
    import torch

    if not torch.cuda.is_available() or not is_oom(exc):
        return None
    requested = oom_numbers(str(exc)).get("tried_to_allocate")
    try:
        stats = torch.cuda.memory_stats()
        segments = torch.cuda.memory_snapshot()
        device_free = int(torch.cuda.mem_get_info()[0])
        total = int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    except (RuntimeError, MemoryError):
        return None
    limit = limit or total
    facts = allocator.facts_from_allocator(stats, segments, requested, limit=limit, device_free=device_free)
    if shapes is None:
        return facts
    step, peak = shapes.last_with(shapes.current)
    return dataclasses.replace(
        facts, batch_shape=shapes.current, same_shape_step=step, same_shape_peak_bytes=peak
    )


class StepShapes:
    """After an OOM: whether a step of the shape in flight (``current``) already fitted in this attempt."""

    def __init__(self) -> None:
        self.current: tuple[int, ...] | None = None
        self._in_step: set[tuple[int, ...]] = set()
        self._done: dict[tuple[int, ...], tuple[int, int | None]] = {}

    def micro_batch(self, shape: tuple[int, ...]) -> None:
        self.current = shape
        self._in_step.add(shape)

    def step_done(self, step: int, peak: int | None) -> None:
        self._done.update(dict.fromkeys(self._in_step, (step, peak)))
        self._in_step.clear()

    def last_with(self, shape: tuple[int, ...] | None) -> tuple[int | None, int | None]:
        return (None, None) if shape is None else self._done.get(shape, (None, None))
