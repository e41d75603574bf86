"""The allocator-message parser, on PyTorch's documented wording families (our own numbers)."""

from __future__ import annotations

from typing import Any

import pytest

from qlora_supervise.trainer_child.contract.oom_message import (
    OomMessage,
    parse_messages,
    parse_numbers,
    size_bytes,
)

KIB, MIB, GIB = 1024, 1024**2, 1024**3
NEW_HINT = (
    "If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation "
    "for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
OLD_HINT = (
    "If reserved memory is >> allocated memory try setting max_split_size_mb to avoid "
    "fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF"
)

# The message our H200 run produced with an 8 GiB cap (quoted in the project's GPU notes).
H200_CAPPED = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 204.00 MiB. GPU 0 has a total "
    "capacity of 139.80 GiB of which 131.17 GiB is free. Including non-PyTorch memory, this process "
    "has 8.62 GiB memory in use. 8.00 GiB allowed; Of the allocated memory 7.58 GiB is allocated by "
    "PyTorch, and 306.47 MiB is reserved by PyTorch but unallocated. " + NEW_HINT
)
# The CPU allocator's message, as torch raises it under RLIMIT_DATA.
CPU_MESSAGE = (
    "RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate "
    "memory: you tried to allocate 268435456 bytes. Error code 12 (Cannot allocate memory)"
)


def gib(value: float) -> int:
    return round(value * GIB)


def mib(value: float) -> int:
    return round(value * MIB)


CASES: list[tuple[str, str, dict[str, Any], tuple[str, int | None, str]]] = [
    (
        "old wording (1.5-2.0)",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 MiB (GPU 0; "
        "15.78 GiB total capacity; 14.20 GiB already allocated; 12.50 MiB free; 14.61 GiB reserved "
        "in total by PyTorch) " + OLD_HINT,
        {
            "tried_to_allocate": mib(64),
            "total_capacity": gib(15.78),
            "already_allocated": gib(14.20),
            "free": mib(12.5),
            "reserved_total": gib(14.61),
        },
        ("cuda", 0, "old"),
    ),
    (
        "old wording with the allowed clause",
        "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 3; 39.59 GiB total "
        "capacity; 7.10 GiB already allocated; 30.02 GiB free; 8.00 GiB allowed; 7.50 GiB reserved "
        "in total by PyTorch)",
        {
            "tried_to_allocate": gib(2),
            "total_capacity": gib(39.59),
            "already_allocated": gib(7.10),
            "free": gib(30.02),
            "allowed": gib(8),
            "reserved_total": gib(7.5),
        },
        ("cuda", 3, "old"),
    ),
    (
        "pre-1.5 cached form: cached is the unallocated part",
        "RuntimeError: CUDA out of memory. Tried to allocate 1.50 GiB (GPU 1; 11.17 GiB total "
        "capacity; 9.01 GiB already allocated; 700.25 MiB free; 120.44 MiB cached)",
        {
            "tried_to_allocate": gib(1.5),
            "total_capacity": gib(11.17),
            "already_allocated": gib(9.01),
            "free": mib(700.25),
            "reserved_unallocated": mib(120.44),
        },
        ("cuda", 1, "cached"),
    ),
    (
        "new wording, capped process (our H200 run)",
        H200_CAPPED,
        {
            "tried_to_allocate": mib(204),
            "total_capacity": gib(139.80),
            "free": gib(131.17),
            "process_in_use": gib(8.62),
            "allowed": gib(8),
            "already_allocated": gib(7.58),
            "reserved_unallocated": mib(306.47),
        },
        ("cuda", 0, "new"),
    ),
    (
        "new wording with other processes and private pools",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 2 has a total "
        "capacity of 79.19 GiB of which 512.00 KiB is free. Process 4242 has 40.00 GiB memory in use. "
        "Process 4343 has 0 bytes memory in use. Including non-PyTorch memory, this process has "
        "39.10 GiB memory in use. Of the allocated memory 36.00 GiB is allocated by PyTorch, with "
        "12.00 MiB allocated in private pools (e.g., CUDA Graphs), and 2.50 GiB is reserved by "
        "PyTorch but unallocated. " + NEW_HINT,
        {
            "tried_to_allocate": gib(1),
            "total_capacity": gib(79.19),
            "free": 512 * KIB,
            "processes": {4242: gib(40), 4343: 0},
            "process_in_use": gib(39.10),
            "already_allocated": gib(36),
            "private_pools": mib(12),
            "reserved_unallocated": gib(2.5),
        },
        ("cuda", 2, "new"),
    ),
    (
        "torch 2.1 'capacty' spelling, no index after GPU",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU  has a "
        "total capacty of 7.79 GiB of which 0 bytes is free. Of the allocated memory 6.90 GiB is "
        "allocated by PyTorch, and 101.00 MiB is reserved by PyTorch but unallocated.",
        {
            "tried_to_allocate": mib(20),
            "total_capacity": gib(7.79),
            "free": 0,
            "already_allocated": gib(6.90),
            "reserved_unallocated": mib(101),
        },
        ("cuda", None, "new"),
    ),
    (
        "HIP, new wording",
        "torch.OutOfMemoryError: HIP out of memory. Tried to allocate 256.00 MiB. GPU 1 has a total "
        "capacity of 63.98 GiB of which 100.00 MiB is free. Of the allocated memory 60.00 GiB is "
        "allocated by PyTorch, and 1.25 GiB is reserved by PyTorch but unallocated.",
        {
            "tried_to_allocate": mib(256),
            "total_capacity": gib(63.98),
            "free": mib(100),
            "already_allocated": gib(60),
            "reserved_unallocated": gib(1.25),
        },
        ("hip", 1, "new"),
    ),
    (
        "XPU, new wording without a free clause",
        "torch.OutOfMemoryError: XPU out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total "
        "capacity of 47.98 GiB. Of the allocated memory 40.00 GiB is allocated by PyTorch, and "
        "6.00 GiB is reserved by PyTorch but unallocated. Please use `empty_cache` to release all "
        "unoccupied cached memory.",
        {
            "tried_to_allocate": gib(3),
            "total_capacity": gib(47.98),
            "already_allocated": gib(40),
            "reserved_unallocated": gib(6),
        },
        ("xpu", 0, "new"),
    ),
    (
        "XPU, old wording without free",
        "RuntimeError: XPU out of memory. Tried to allocate 512.00 MiB (GPU 0; 15.00 GiB total "
        "capacity; 14.00 GiB already allocated; 14.25 GiB reserved in total by PyTorch)",
        {
            "tried_to_allocate": mib(512),
            "total_capacity": gib(15),
            "already_allocated": gib(14),
            "reserved_total": gib(14.25),
        },
        ("xpu", 0, "old_no_free"),
    ),
    (
        "CPU allocator",
        CPU_MESSAGE,
        {"tried_to_allocate": 268435456},
        ("cpu", None, "cpu"),
    ),
    (
        "cudaMallocAsync backend",
        "RuntimeError: Allocation on device 0 would exceed allowed memory. (out of memory)\n"
        "Currently allocated     : 9.50 GiB\nRequested               : 1.00 GiB\n"
        "Device limit            : 10.00 GiB\nFree (according to CUDA): 300.00 MiB\n"
        "PyTorch limit (set by user-supplied memory fraction)\n                        : 10.00 GiB",
        {
            "already_allocated": gib(9.5),
            "tried_to_allocate": gib(1),
            "total_capacity": gib(10),
            "free": mib(300),
            "allowed": gib(10),
        },
        ("cuda", 0, "async"),
    ),
]


@pytest.mark.parametrize(("name", "text", "numbers", "head"), CASES, ids=[c[0] for c in CASES])
def test_parse_numbers_per_format(
    name: str, text: str, numbers: dict[str, Any], head: tuple[str, int | None, str]
) -> None:
    """Each wording family yields exactly the numbers it prints, in bytes, and its device/format."""
    assert parse_numbers(text) == numbers
    message = parse_messages(text)[0]
    assert (message.device, message.gpu, message.format) == head


def test_size_bytes_rounds_the_printed_value_times_its_unit() -> None:
    """Printed sizes become bytes: value times 1024**k, rounded to the nearest byte."""
    assert size_bytes("1.65", "GiB") == 1771674010
    assert size_bytes("743.50", "KiB") == 761344
    assert size_bytes("0", "bytes") == 0


def test_messages_run_together_on_one_line_are_split() -> None:
    """Two ranks' messages printed into one line come back as two messages with their own GPU."""
    one = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU {g}; 10.00 GiB total capacity; 9.00 GiB already allocated; {f} free; 9.50 GiB reserved in total by PyTorch) "  # noqa: E501
    text = one.format(g=0, f="10.00 MiB") + "PYTORCH_CUDA_ALLOC_CONF" + one.format(g=5, f="20.00 MiB")
    messages = parse_messages(text)
    assert [(m.gpu, m.numbers["free"]) for m in messages] == [(0, mib(10)), (5, mib(20))]


def test_hard_wrapped_and_prefixed_message() -> None:
    """A message wrapped over lines and behind a log prefix parses as if printed on one line."""
    text = (
        "ERROR 01-02 03:04:05 [worker.py:10] OutOfMemoryError: CUDA out of memory. Tried to allocate\n"
        "1.00 GiB (GPU 0; 8.00 GiB total capacity; 6.00 GiB \nalready allocated; 0 bytes free; "
        "7.50 GiB reserved in total by PyTorch)"
    )
    assert parse_numbers(text)["already_allocated"] == gib(6)
    assert parse_numbers(text)["free"] == 0


def test_cut_message_keeps_what_it_printed() -> None:
    """A message cut short still gives the request and, in the old form, the GPU index."""
    [message] = parse_messages(
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 86.00 MiB (GPU 1;"
    )
    assert message == OomMessage("cuda", 1, "old", {"tried_to_allocate": mib(86)}, message.start)


def test_no_message_gives_empty_numbers() -> None:
    """Text without an allocator message gives no numbers (a driver-level error has none)."""
    assert parse_numbers("RuntimeError: CUDA error: out of memory") == {}
    assert parse_messages("all good") == []


def test_newer_cpu_allocator_wording() -> None:
    """torch's newer CPU message (``err == 0.``) is read the same way."""
    text = (
        "RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
        "allocate memory: you tried to allocate 8589934592 bytes. Error code 12 (Cannot allocate memory)"
    )
    assert parse_numbers(text) == {"tried_to_allocate": 8 * GIB}


def test_module_uses_the_standard_library_only() -> None:
    """The child imports the parser before torch is set up: stdlib, pydantic and contract imports only."""
    import ast
    import sys
    from pathlib import Path

    import qlora_supervise.trainer_child.contract.oom_message as module

    tree = ast.parse(Path(module.__file__).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert imported <= set(sys.stdlib_module_names) | {"__future__", "qlora_supervise", "pydantic"}
