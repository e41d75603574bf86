"""The attempt spec the supervisor writes and the child reads: knobs, data, training, resources, the speed
trial's candidates (timed in-process before step 1, results in :class:`~.events.SpeedTrialEvent`), and the
card a rank trains on: one device mapping (:func:`bind_device`), the same on both sides."""

from __future__ import annotations

import dataclasses
import itertools
import json
import signal
from pathlib import Path

from pydantic import TypeAdapter


@dataclasses.dataclass(frozen=True)
class TrialCandidate:
    """One config the trial times: the knobs that change without a reload, and the planner's guess."""

    micro_batch_size: int
    grad_accum: int
    gradient_checkpointing: bool
    predicted_tokens_per_s: float | None = None
    predicted_peak_bytes: int | None = None
    predicted_host_bytes: int | None = None  # the host model's training peak (None: unplanned)

    @property
    def name(self) -> str:
        checkpointing = ", checkpointing" if self.gradient_checkpointing else ""
        return f"micro-batch {self.micro_batch_size} x {self.grad_accum}{checkpointing}"


@dataclasses.dataclass(frozen=True)
class Knobs:
    """Everything the policy ladder may change between attempts; rungs keep the effective batch.
    ``world_size`` above 1: torchrun, one rank per GPU, all with these knobs."""

    model: str
    micro_batch_size: int = 1
    grad_accum: int = 16
    max_seq_len: int = 512
    gradient_checkpointing: bool = True
    optimizer: str = "paged_adamw_8bit"
    lora_r: int = 8
    lora_alpha: int = 16
    quant_type: str = "nf4"
    double_quant: bool = True
    load_in_4bit: bool = True
    cpu_offload: bool = False  # old specs only: refused at validate (4-bit weights cannot train offloaded)
    bf16_head: bool = False  # embeddings and LM head kept out of prepare's fp32 upcast
    activation_offload: bool = False  # activations saved for backward in host memory
    expandable_segments: bool = True  # no tokens/s lost on the H200, 0.7 GiB less reserved
    eval_batch_size: int = 1
    eval_enabled: bool = True
    merge_on_cpu: bool = False
    optimizer_state_on_host: bool = False  # resume: read it into host memory, not onto the card whole
    fresh_optimizer_state: bool = False  # resume: a fresh optimizer state, the LR schedule kept
    world_size: int = 1
    gpus: str = ""  # the ranks' positions in CUDA_VISIBLE_DEVICES, comma-separated; "": the first ones
    fsdp: bool = False  # FSDP-QLoRA: the ranks shard the 4-bit weights instead of holding replicas

    @property
    def effective_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.world_size


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """Where the training text comes from."""

    path: str
    text_field: str | None = "text"
    messages_field: str | None = None
    eval_path: str | None = None
    eval_fraction: float = 0.0


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """The parts of the recipe no rung changes."""

    learning_rate: float = 2e-4
    lr_scheduler: str = "cosine"
    warmup_ratio: float = 0.03
    max_grad_norm: float = 0.3
    max_steps: int = -1
    epochs: float = 1.0
    save_steps: int = 50
    logging_steps: int = 10
    eval_steps: int | None = None
    packing: bool = False
    seed: int = 42
    lora_dropout: float = 0.05
    target_modules: tuple[str, ...] | str = ("q_proj", "k_proj", "v_proj", "o_proj")
    compute_dtype: str = "auto"
    trust_remote_code: bool = False
    merge: bool = False
    report_to: str = "none"  # or "tensorboard" (<run_dir>/tensorboard, across attempts)


@dataclasses.dataclass(frozen=True)
class Resources:
    """Where the child runs and the memory caps it applies to itself (bytes; None: no cap)."""

    device: str = "auto"  # "auto", "cpu", "cuda:N" or a GPU UUID
    gpu_memory_limit: int | None = None
    cpu_memory_limit: int | None = None
    host_memory_limit: int | None = None  # the plan's host budget, not a cap the child applies


@dataclasses.dataclass(frozen=True)
class DiagnoseSpec:
    """Opt-in diagnostics: the CUDA allocator's history, dumped at an OOM (:data:`MEMORY_SNAPSHOT_NAME`)."""

    memory_history: bool = False
    memory_history_entries: int = 100_000


MEMORY_SNAPSHOT_NAME = "memory-snapshot.pickle"
#: Sent when memory creeps towards the budget: the child checkpoints after this step and every next.
EARLY_CHECKPOINT_SIGNAL = signal.SIGUSR1


@dataclasses.dataclass(frozen=True)
class AttemptSpec:
    """One attempt of the child: what to train, with which knobs, where to write, which caps."""

    attempt: int
    run_dir: str
    knobs: Knobs
    data: DataSpec
    train: TrainSpec
    events_file: str
    error_file: str
    checkpoints_dir: str
    adapter_dir: str
    merged_dir: str
    device: str = "auto"  # mapped by bind_device on both sides
    gpu_memory_limit: int | None = None  # bytes
    cpu_memory_limit: int | None = None  # bytes
    heartbeat_interval: float = 5.0
    resume_from: str | None = None  # None: start from step 0
    reset_optimizer: bool = False  # keep adapter, step and data position; a fresh optimizer state
    diagnose: DiagnoseSpec = DiagnoseSpec()
    stop_grace_s: float = 180.0  # SIGTERM to SIGKILL, torchrun's too: the ranks' checkpoint fits in it
    speed_trial: tuple[TrialCandidate, ...] = ()  # the first is these knobs; empty: no trial
    speed_trial_limit_bytes: int | None = None  # a candidate above it is dropped, as by an OOM
    speed_trial_on_resume: bool = False  # the card's sharing changed since the last trial
    command: tuple[str, ...] = ()  # a trainer that is not ours, run with the shim; empty: our child

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> AttemptSpec:
        """Raises ValueError; unknown fields are ignored (a shim reads a newer supervisor's spec)."""
        return _SPEC.validate_json(text)


_SPEC = TypeAdapter(AttemptSpec)


def rank_gpus(knobs: Knobs) -> list[int]:
    """The positions (in the visible GPUs) that ranks 0, 1, ... of ``knobs`` train on."""
    return [int(part) for part in knobs.gpus.split(",")] if knobs.gpus else list(range(knobs.world_size))


def rank_file(path: str, rank: int) -> str:
    """Where rank ``rank`` writes a file the spec names: rank N > 0 ``<stem>.rankN<suffix>`` beside it."""
    name = Path(path)
    return str(name.with_name(f"{name.stem}.rank{rank}{name.suffix}")) if rank else path


def rank_files(path: str) -> list[tuple[int, str]]:
    """``(rank, path)`` of every rank file of ``path`` that exists, rank 0 first."""
    found = [(0, path)] if Path(path).is_file() else []
    name = Path(path)
    for other in sorted(name.parent.glob(f"{name.stem}.rank*{name.suffix}")):
        number = other.name[len(name.stem) + len(".rank") : len(other.name) - len(name.suffix)]
        if number.isdigit() and int(number) > 0:
            found.append((int(number), str(other)))
    return sorted(found)


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
    """Map the job's ``device`` (``auto``, ``cpu``, ``N`` / ``cuda:N``: the N-th visible GPU, or a GPU/MIG
    UUID) through the inherited ``CUDA_VISIBLE_DEVICES``, alike on both sides; raises :class:`DeviceError`."""
    if (text := device.strip()) == "cpu":
        return DeviceBinding("", None)
    if text.startswith(_UUID_PREFIXES):
        return DeviceBinding(text, text)
    index = "0" if text == "auto" else text.removeprefix("cuda:")
    if not index.isdigit():
        raise DeviceError(
            f"device {device!r}: use auto, cpu, a GPU index (0), cuda:N, or a GPU UUID (GPU-... or MIG-...)"
        )
    position = int(index)
    if (visible := visible_entries(inherited_visible)) is None:
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
    entries = (raw.strip() for raw in value.split(","))
    return list(itertools.takewhile(lambda gpu: gpu.isdigit() or gpu.startswith(_UUID_PREFIXES), entries))
