"""``qlora-supervise classify FILE [--json]``: classify a failure from a log or traceback."""

from __future__ import annotations

import json
import sys
from collections.abc import Collection
from pathlib import Path

from qlora_supervise.supervisor.diagnosis.classify import classify_text
from qlora_supervise.supervisor.facts.failure import Failure
from qlora_supervise.trainer_child.contract.oom_message import parse_numbers

# (key, label) in the order a person reads an OOM message.
NUMBER_LABELS: tuple[tuple[str, str], ...] = (
    ("tried_to_allocate", "requested"),
    ("total_capacity", "total capacity"),
    ("free", "free"),
    ("process_in_use", "this process (incl. non-PyTorch)"),
    ("allowed", "allowed (capped)"),
    ("already_allocated", "allocated by PyTorch"),
    ("reserved_total", "reserved by PyTorch"),
    ("reserved_unallocated", "reserved but unallocated"),
    ("private_pools", "in private pools"),
    ("others_in_use", "other processes"),
    ("spurious_room", "there for it (spurious)"),
)


def classify_command(path: str, as_json: bool) -> int:
    """Print the classification of ``path`` (``-``: standard input). 0 when read, 2 when not."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as error:
        missing = isinstance(error, FileNotFoundError)
        why = f"no such file: {path}" if missing else f"cannot read {path}: {error.strerror}"
        print(f"qlora-supervise classify: {why}", file=sys.stderr)
        return 2
    failure = classify_text(text)
    if as_json:
        print(json.dumps(failure.to_json(), sort_keys=False))
    else:
        print("\n".join(human_lines(failure, printed=parse_numbers(text).keys())))
    return 0


def human_lines(failure: Failure, printed: Collection[str] = ()) -> list[str]:
    """The failure for a person; numbers not in ``printed`` are marked as derived."""
    lines = [f"kind      {failure.kind.value}", f"stage     {failure.stage.value}"]
    numbers = [
        f"  {label:<34}{format_size(int(failure.numbers[key]))}{'' if key in printed else '  (derived)'}"
        for key, label in NUMBER_LABELS
        if key in failure.numbers
    ]
    processes = dict(failure.numbers.get("processes", {})).items()
    numbers += [f"  {'process ' + str(pid):<34}{format_size(int(size))}" for pid, size in processes]
    if numbers:
        lines += ["numbers", *numbers]
    if failure.message:
        lines.append(f"message   {failure.message}")
    lines.append(f"evidence  {failure.evidence}")
    return lines


def format_size(size: int) -> str:
    """PyTorch's size format: bytes up to 1 KiB, KiB up to 1 MiB, MiB up to 1 GiB, then GiB."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if size > scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size} bytes"
