"""Every rank's card under torchrun: one NVML monitor per card the attempt's ranks train on.

Local rank N trains on ``cuda:N`` of the child's ``CUDA_VISIBLE_DEVICES``, narrowed to the positions
``Knobs.gpus`` names; the supervisor maps the same positions with the one device mapping
(``contract.devices.bind_device``). Opened per attempt: a card ``drop_rank`` left out is not watched.
"""

from __future__ import annotations

from collections.abc import Mapping

from qlora_supervise.supervisor.watching.gpu import GpuMonitor, GpuSample, Nvml
from qlora_supervise.trainer_child.contract.spec import Knobs, rank_gpus


class RankCards:
    """One :class:`GpuMonitor` per local rank whose card NVML could open."""

    def __init__(self, monitors: Mapping[int, GpuMonitor]) -> None:
        self._monitors = dict(monitors)

    @classmethod
    def open(cls, knobs: Knobs, device: str, *, nvml: Nvml | None = None) -> RankCards | None:
        """The cards of ``knobs``' ranks; None for a single process on the first card (a single one
        that ``drop_rank`` left is watched here), on the CPU, or when NVML opens no card."""
        if (knobs.world_size <= 1 and not knobs.gpus) or device == "cpu":
            return None
        monitors = {}
        for local_rank, position in enumerate(rank_gpus(knobs)):
            monitor = GpuMonitor.open(f"cuda:{position}", nvml=nvml)
            if monitor is not None:
                monitors[local_rank] = monitor
        return cls(monitors) if monitors else None

    @property
    def indexes(self) -> dict[int, int]:
        """Local rank -> the NVML (physical) index of its card."""
        return {rank: monitor.index for rank, monitor in self._monitors.items()}

    def sample(self, pids: set[int]) -> dict[int, GpuSample]:
        """One sample per card that answered, by local rank (``pids``: the child's whole tree)."""
        found = {}
        for rank, monitor in self._monitors.items():
            sample = monitor.sample(pids)
            if sample is not None:
                found[rank] = sample
        return found

    def close(self) -> None:
        for monitor in self._monitors.values():
            monitor.close()
        self._monitors.clear()
