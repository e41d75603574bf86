"""Which card a rank trains on: one device mapping, computed the same way by both sides."""

from __future__ import annotations

import dataclasses


class DeviceError(ValueError):
    """A job's device that names no GPU this process could hand to the child."""


@dataclasses.dataclass(frozen=True)
class DeviceBinding:
    """The one GPU an attempt trains on: the child's ``CUDA_VISIBLE_DEVICES`` (``""``: none), and what
    the supervisor's NVML monitor watches (a physical index, a UUID or unique prefix, or None)."""

    child_visible_devices: str
    nvml_target: int | str | None


_UUID_PREFIXES = ("GPU-", "MIG-")


def bind_device(device: str, inherited_visible: str | None) -> DeviceBinding:
    """Map the job's ``device`` (``auto``, ``cpu``, ``N`` / ``cuda:N``: the N-th visible GPU, or a
    GPU/MIG UUID) through the inherited ``CUDA_VISIBLE_DEVICES``, the same on both sides; raises
    :class:`DeviceError`."""
    text = device.strip()
    if text == "cpu":
        return DeviceBinding("", None)
    if text.startswith(_UUID_PREFIXES):
        return DeviceBinding(text, text)
    if text == "auto":
        position = 0
    elif text.removeprefix("cuda:").isdigit():
        position = int(text.removeprefix("cuda:"))
    else:
        raise DeviceError(
            f"device {device!r}: use auto, cpu, a GPU index (0), cuda:N, or a GPU UUID (GPU-... or MIG-...)"
        )
    visible = visible_entries(inherited_visible)
    if visible is None:
        return DeviceBinding(str(position), position)
    if position >= len(visible):
        if text == "auto":  # nothing visible: an auto job trains on the CPU
            return DeviceBinding("", None)
        raise DeviceError(
            f"device {device!r}: CUDA_VISIBLE_DEVICES={inherited_visible!r} makes {len(visible)} GPU(s) "
            f"visible; use an index below {len(visible)}, a GPU UUID, or change CUDA_VISIBLE_DEVICES"
        )
    entry = visible[position]
    return DeviceBinding(entry, int(entry) if entry.isdigit() else entry)


def visible_entries(value: str | None) -> list[str] | None:
    """The GPUs a ``CUDA_VISIBLE_DEVICES`` value lists, up to the first bad entry as in CUDA; None: unset."""
    if value is None:
        return None
    entries: list[str] = []
    for raw in value.split(","):
        entry = raw.strip()
        if not (entry.isdigit() or entry.startswith(_UUID_PREFIXES)):
            break
        entries.append(entry)
    return entries
