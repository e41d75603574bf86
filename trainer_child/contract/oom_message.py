"""The numbers of allocator out-of-memory messages (PyTorch 1.5-2.0's ``old``, 2.1+'s ``new``,
``cudaMallocAsync``'s ``async``, ``DefaultCPUAllocator``'s ``cpu``), for the child's error report
and the supervisor's reading of logs of commands that are not ours; only what a message prints."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from pydantic import TypeAdapter, ValidationError

from qlora_supervise.trainer_child.contract.byte_sizes import BYTE_UNITS

_SIZE = r"(\d+(?:\.\d+)?)\s*(bytes|B|KiB|MiB|GiB|TiB)\b"

# The start of each message. Everything up to the next start belongs to that message.
_START = re.compile(
    r"(?P<dev>CUDA|HIP|XPU|MPS)?\s?out of memory\.\s*Tried to allocate"
    r"|(?P<xpu4g>can NOT allocate memory block with size larger than 4GB!)\s*Tried to allocate"
    r"|(?P<async>Allocation on device (?P<adev>\d+) would exceed allowed memory)"
    r"|(?P<cpu>DefaultCPUAllocator: can't allocate memory)",
    re.IGNORECASE,
)
_MAX_BODY = 2000  # a message is a few hundred characters; the rest of a log is not its business

# (key, pattern) for the allocator wordings, first match per key; group 1-2 of each is a size.
_FIELDS = (
    ("tried_to_allocate", rf"Tried to allocate {_SIZE}"),
    ("total_capacity", rf"{_SIZE} total capacity"),
    ("total_capacity", rf"a total capac(?:i)?ty of {_SIZE}"),
    ("free", rf"{_SIZE} free\b"),
    ("free", rf"of which {_SIZE} is free"),
    ("already_allocated", rf"{_SIZE} already allocated"),
    ("already_allocated", rf"Of the allocated memory {_SIZE} is allocated by PyTorch"),
    ("reserved_total", rf"{_SIZE} reserved in total by PyTorch"),
    ("reserved_unallocated", rf"{_SIZE} is reserved by PyTorch but unallocated"),
    # pre-1.5: "cached" was the cached-but-unallocated amount (cached minus allocated)
    ("reserved_unallocated", rf"{_SIZE} cached\)"),
    ("process_in_use", rf"this process has {_SIZE} memory in use"),
    ("allowed", rf"{_SIZE} allowed;"),
    ("private_pools", rf"with {_SIZE} allocated in private pools"),
)
_PROCESS = re.compile(rf"Process (\d+) has {_SIZE} memory in use")
_ASYNC_FIELDS = (
    ("already_allocated", rf"Currently allocated\s*:\s*{_SIZE}"),
    ("tried_to_allocate", rf"Requested\s*:\s*{_SIZE}"),
    ("total_capacity", rf"Device limit\s*:\s*{_SIZE}"),
    ("free", rf"Free \(according to CUDA\)\s*:\s*{_SIZE}"),
    ("allowed", rf"PyTorch limit \(set by user-supplied memory fraction\)\s*:\s*{_SIZE}"),
)
_CPU_TRIED = re.compile(r"you tried to allocate (\d+) bytes")
_OLD_GPU = re.compile(r"\(GPU\s*(\d+)\s*;")
_NEW_GPU = re.compile(r"\bGPU\s*(\d*)\s*has a total capac")


@dataclasses.dataclass(frozen=True)
class OomMessage:
    """One allocator message in a text: ``format`` old, old_no_free, cached, new, async, cpu or short
    (cut off before any wording's own clause); ``start`` its offset."""

    device: str
    gpu: int | None
    format: str
    numbers: Mapping[str, Any]
    start: int = 0


def size_bytes(number: str, unit: str) -> int:
    """``("1.65", "GiB")`` -> 1771674010: the printed value times its unit, rounded."""
    return round(float(number) * BYTE_UNITS[unit.lower()])


def parse_messages(text: str) -> list[OomMessage]:
    """Every allocator OOM message in ``text``, in order of appearance."""
    starts = list(_START.finditer(text))
    ends = [match.start() for match in starts[1:]] + [len(text)]
    return [
        _message(match, " ".join(text[match.start() : min(end, match.start() + _MAX_BODY)].split()))
        for match, end in zip(starts, ends, strict=False)
    ]


def parse_numbers(text: str) -> dict[str, Any]:
    """The numbers of the first allocator message in ``text`` (empty when there is none)."""
    return next((dict(message.numbers) for message in parse_messages(text)), {})


def _message(start: re.Match[str], body: str) -> OomMessage:
    numbers: dict[str, Any]
    if start.group("cpu"):
        numbers = {"tried_to_allocate": int(tried.group(1))} if (tried := _CPU_TRIED.search(body)) else {}
        return OomMessage("cpu", None, "cpu", numbers, start.start())
    if start.group("async"):
        numbers = _sizes(body, _ASYNC_FIELDS)
        return OomMessage("cuda", int(start.group("adev")), "async", numbers, start.start())
    device = "xpu" if start.group("xpu4g") else (start.group("dev") or "cuda").lower()
    numbers = _sizes(body, _FIELDS)
    if processes := {int(pid): size_bytes(n, u) for pid, n, u in _PROCESS.findall(body)}:
        numbers["processes"] = processes
    found = _OLD_GPU.search(body) or _NEW_GPU.search(body)
    gpu = int(found.group(1)) if found and found.group(1) else None
    return OomMessage(device, gpu, _format(body, numbers), numbers, start.start())


def _sizes(body: str, fields: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    numbers: dict[str, Any] = {}
    for key, pattern in fields:
        found = re.search(pattern, body)  # re caches the compiled pattern
        if found and key not in numbers:
            numbers[key] = size_bytes(found.group(1), found.group(2))
    return numbers


def _format(body: str, numbers: Mapping[str, Any]) -> str:
    if "cached)" in body:
        return "cached"
    if "reserved in total by PyTorch" in body or "total capacity;" in body:
        return "old" if "free" in numbers else "old_no_free"
    if "has a total capac" in body or "Of the allocated memory" in body:
        return "new"
    return "old" if _OLD_GPU.search(body) else "short"


@dataclasses.dataclass(frozen=True)
class OomNumbers:
    """The numbers of one OOM message, in bytes (None: not printed); ``processes``: pid -> bytes."""

    tried_to_allocate: int | None = None
    total_capacity: int | None = None
    free: int | None = None
    already_allocated: int | None = None
    reserved_total: int | None = None
    reserved_unallocated: int | None = None
    process_in_use: int | None = None
    processes: Mapping[int, int] = dataclasses.field(default_factory=dict)
    allowed: int | None = None
    private_pools: int | None = None

    @property
    def step_need_bytes(self) -> int | None:
        """What the failed step needed at least: what PyTorch had allocated plus the request."""
        if self.already_allocated is None or self.tried_to_allocate is None:
            return None
        return self.already_allocated + self.tried_to_allocate

    def to_json(self) -> dict[str, Any]:
        """The report's JSON shape: only the numbers printed, pids as keys."""
        raw: dict[str, Any] = _NUMBERS.dump_python(self, exclude_none=True)
        return {key: value for key, value in raw.items() if value != {}}

    @classmethod
    def from_json(cls, raw: object) -> OomNumbers:
        """The numbers of a report's JSON or of ``parse_numbers``' dict; none when ill-typed."""
        try:
            return _NUMBERS.validate_python(raw)
        except ValidationError:
            return cls()


_NUMBERS = TypeAdapter(OomNumbers)
