"""The attempt spec the supervisor writes and the child reads: knobs, data, training, resources."""

from __future__ import annotations

import dataclasses
import json
import signal
from pathlib import Path

from pydantic import TypeAdapter

from qlora_supervise.trainer_child.contract.speed_trial import TrialCandidate


@dataclasses.dataclass(frozen=True)
class Knobs:
    """Everything the policy ladder may change between attempts.

    ``micro_batch_size * grad_accum * world_size`` is the effective batch; rungs keep it.
    ``world_size`` is the number of ranks (``resources.nproc_per_node``): above 1 the child is
    started through torchrun, one rank per GPU, all ranks with these same knobs.
    """

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
    # Kept so that journals and specs that named it still read; it is no training rung on one GPU
    # (accelerate refuses to train 4-bit weights offloaded to the CPU; bitsandbytes then fails on
    # meta tensors), and a job that names it is refused at validate.
    cpu_offload: bool = False
    # The input embeddings and the LM head stay in bf16 after prepare_model_for_kbit_training
    # (which upcasts every non-4-bit parameter to fp32); norms stay fp32. At a 128k vocabulary
    # each of the two is 2.1 GB in fp32.
    bf16_head: bool = False
    # Activations saved for backward live in host memory (torch.autograd.graph.save_on_cpu):
    # the throughput rung that replaces cpu_offload.
    activation_offload: bool = False
    # On by default: on the H200 it cost no tokens/s (+0.9 %, noise) and reserved 0.7 GiB less
    # (bench/results/memory-grid-h200-2026-12-01/rungs-table.txt), so it needs no attempt of its own.
    expandable_segments: bool = True
    eval_batch_size: int = 1
    eval_enabled: bool = True
    merge_on_cpu: bool = False
    # The resume ladder (issue 33): the checkpoint's optimizer state is read into host memory
    # (map_location cpu) and copied to the card by load_state_dict, where Trainer under torchrun
    # reads it onto the card whole; and a fresh optimizer state with the LR schedule kept, taken
    # when a checkpoint written without it is resumed (supervisor/loop/resume.py).
    optimizer_state_on_host: bool = False
    fresh_optimizer_state: bool = False
    world_size: int = 1  # journals and specs written before it had one process
    # The visible GPUs the ranks train on, by position in CUDA_VISIBLE_DEVICES, comma-separated, in
    # rank order; "" means the first world_size. drop_rank leaves the failing card out of it.
    gpus: str = ""

    @property
    def effective_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.world_size


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """Where the training text comes from (validated by the supervisor before any attempt)."""

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
    # Passed through to the Trainer: "none" or "tensorboard" (logs in <run_dir>/tensorboard,
    # one directory across attempts so the curves continue after a restart).
    report_to: str = "none"


@dataclasses.dataclass(frozen=True)
class Resources:
    """Where the child runs and the memory caps it applies to itself (bytes; None: no cap)."""

    device: str = "auto"  # "auto", "cpu", "cuda:N" or a GPU UUID
    gpu_memory_limit: int | None = None
    cpu_memory_limit: int | None = None
    # The host RAM the plan may give this job (the supervisor's host budget, not a cap the child
    # applies: cpu_memory_limit is that, through RLIMIT_DATA).
    host_memory_limit: int | None = None


@dataclasses.dataclass(frozen=True)
class DiagnoseSpec:
    """Opt-in diagnostics of the child (the job's ``diagnose`` section).

    ``memory_history``: record the CUDA allocator's history
    (``torch.cuda.memory._record_memory_history``, at most ``memory_history_entries`` events)
    and dump it into the attempt's directory at an OOM (:data:`MEMORY_SNAPSHOT_NAME`), for
    PyTorch's memory viewer (https://pytorch.org/memory_viz). Off by default: recording costs
    throughput (README, Benchmarks).
    """

    memory_history: bool = False
    memory_history_entries: int = 100_000


#: The allocator snapshot an OOM leaves in ``attempt-NNN/`` when ``diagnose.memory_history`` is on.
MEMORY_SNAPSHOT_NAME = "memory-snapshot.pickle"


#: Sent by the supervisor when memory creeps towards the budget: the child saves a checkpoint at
#: the end of the step in flight, and after every step from then on (trainer_child/trainer.py).
EARLY_CHECKPOINT_SIGNAL = signal.SIGUSR1


@dataclasses.dataclass(frozen=True)
class AttemptSpec:
    """One attempt of the child: what to train, with which knobs, where to write.

    Memory caps are applied *inside* the child: ``gpu_memory_limit`` through
    ``torch.cuda.set_per_process_memory_fraction``, ``cpu_memory_limit`` through ``RLIMIT_DATA``.
    """

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
    device: str = "auto"  # "auto", "cpu", "cuda:N" or a GPU UUID; both sides map it with bind_device
    gpu_memory_limit: int | None = None  # bytes
    cpu_memory_limit: int | None = None  # bytes
    heartbeat_interval: float = 5.0
    # Chosen by the supervisor (the newest complete checkpoint still valid for these knobs);
    # None: start from step 0.
    resume_from: str | None = None
    # The optimizer changed (or its state is suspect): keep adapter, step and data position,
    # start the optimizer state afresh.
    reset_optimizer: bool = False
    diagnose: DiagnoseSpec = DiagnoseSpec()
    # How long the supervisor waits after SIGTERM before SIGKILL (supervise.stop_grace); torchrun
    # is told the same (--shutdown-timeout), so it does not kill the ranks' checkpoint sooner.
    stop_grace_s: float = 180.0
    # The speed trial (supervise.speed_trial): candidates the child times in-process before
    # step 1, the first being these knobs; empty: no trial (contract/speed_trial.py).
    speed_trial: tuple[TrialCandidate, ...] = ()
    # The most a candidate may measure in the trial: the budget the pre-flight planned with, less
    # its margin (a candidate above it is dropped as an OOM would drop it); None: no such check.
    speed_trial_limit_bytes: int | None = None
    # A trainer that is not ours (the job's ``trainer:`` section): its argv, the per-attempt config
    # in the attempt's directory on it, run with the shim on its PYTHONPATH (trainer_child/shim/);
    # empty: our own child.
    command: tuple[str, ...] = ()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> AttemptSpec:
        """The spec (pydantic's ValidationError, a ValueError, for one that is not); a field this
        version does not know is ignored, so a shim in a tool's venv reads a newer supervisor's spec."""
        return _SPEC.validate_json(text)


_SPEC = TypeAdapter(AttemptSpec)


def rank_gpus(knobs: Knobs) -> list[int]:
    """The positions (in the visible GPUs) that ranks 0, 1, ... of ``knobs`` train on."""
    if not knobs.gpus:
        return list(range(knobs.world_size))
    return [int(part) for part in knobs.gpus.split(",")]


def rank_file(path: str, rank: int) -> str:
    """Where rank ``rank`` writes a file the spec names once: rank 0 (and a single process) the
    path itself, rank N ``<stem>.rankN<suffix>`` beside it (``error.rank1.json``,
    ``child-events.rank1.jsonl``).

    Every rank writes its own error report and events (heartbeats with its own peak memory); only
    rank 0 writes checkpoints, the adapter and the ``finished`` event the supervisor waits for.
    """
    if rank == 0:
        return path
    name = Path(path)
    return str(name.with_name(f"{name.stem}.rank{rank}{name.suffix}"))


def rank_files(path: str) -> list[tuple[int, str]]:
    """``(rank, path)`` of every rank file of ``path`` that exists, rank 0 first."""
    found = [(0, path)] if Path(path).is_file() else []
    name = Path(path)
    for other in sorted(name.parent.glob(f"{name.stem}.rank*{name.suffix}")):
        number = other.name[len(name.stem) + len(".rank") : len(other.name) - len(name.suffix)]
        if number.isdigit() and int(number) > 0:
            found.append((int(number), str(other)))
    return sorted(found)
