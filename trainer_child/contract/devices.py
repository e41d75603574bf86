"""Which card a rank trains on: one device mapping, computed the same way by both sides."""

from __future__ import annotations

import dataclasses


class DeviceError(ValueError):
    """A job's device that names no GPU this process could hand to the child."""


@dataclasses.dataclass(frozen=True)
class DeviceBinding:
    """The one GPU an attempt trains on, named as each side needs it.

    ``child_visible_devices`` is what the child sets ``CUDA_VISIBLE_DEVICES`` to before CUDA
    starts (``""`` hides every GPU), so that it sees exactly that GPU as ``cuda:0``.
    ``nvml_target`` is what the supervisor's NVML monitor watches: a physical index (NVML ignores
    ``CUDA_VISIBLE_DEVICES``), a ``GPU-``/``MIG-`` UUID or unique UUID prefix, or None for nothing.
    """

    child_visible_devices: str
    nvml_target: int | str | None


_UUID_PREFIXES = ("GPU-", "MIG-")


def bind_device(device: str, inherited_visible: str | None) -> DeviceBinding:
    """Map the job's ``device`` through the ``CUDA_VISIBLE_DEVICES`` both sides inherit.

    ``device`` is ``auto`` (the first visible GPU), ``cpu``, ``N`` or ``cuda:N`` (the N-th GPU
    *visible to the supervisor*, as CUDA itself would count it), or a GPU/MIG UUID (that GPU,
    whatever the list says). The supervisor and the child both call this with the same inputs
    (the child inherits the supervisor's environment), so they cannot disagree on the GPU.
    Without the variable, index N means CUDA's device N, which NVML numbers the same only when
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or all GPUs are one model. Raises :class:`DeviceError`
    for an unknown form or an index beyond the visible list.
    """
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
    """The GPUs a ``CUDA_VISIBLE_DEVICES`` value lists, in order; None when it is unset.

    Like CUDA, the list ends at the first entry that is neither an index nor a UUID (``-1``
    hides every GPU after it).
    """
    if value is None:
        return None
    entries: list[str] = []
    for raw in value.split(","):
        entry = raw.strip()
        if not (entry.isdigit() or entry.startswith(_UUID_PREFIXES)):
            break
        entries.append(entry)
    return entries
