"""The loop on a fake clock: whole runs with no process, each in well under a second.

The seams replace the clock, sleep, spawn and the GPU probe. A fake child "runs" by writing
what the real protocol carries (heartbeats, checkpoints with their marker, an error report)
when the fake clock passes its end, so the loop's real judging, policy and journal run.
"""

from __future__ import annotations

import dataclasses
import io
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.loop.seams import Seams
from qlora_supervise.supervisor.record.eventlog import read_events
from qlora_supervise.supervisor.record.journal import RunState, read_attempts, read_state
from qlora_supervise.supervisor.watching.gpu import GpuSample
from qlora_supervise.trainer_child.contract.checkpoint_dirs import CHECKPOINT_COMPLETE_MARKER
from qlora_supervise.trainer_child.contract.codes import ExitCode
from qlora_supervise.trainer_child.contract.events import event_line
from qlora_supervise.trainer_child.contract.report import ErrorReport
from qlora_supervise.trainer_child.contract.spec import AttemptSpec

GiB = 1024**3
OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
    "of 23.55 GiB of which 1.10 GiB is free. Including non-PyTorch memory, this process has 22.44 GiB "
    "memory in use. Of the allocated memory 21.90 GiB is allocated by PyTorch, and 120.00 MiB is reserved "
    "by PyTorch but unallocated."
)
CONTENTION = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity "
    "of 23.55 GiB of which 200.00 MiB is free. Process 4242 has 18.00 GiB memory in use. Including "
    "non-PyTorch memory, this process has 5.30 GiB memory in use. Of the allocated memory 4.90 GiB is "
    "allocated by PyTorch, and 100.00 MiB is reserved by PyTorch but unallocated."
)


class FakeClock:
    """Monotonic and wall time that move only when the loop sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 0.001)


@dataclasses.dataclass
class FakeChild:
    """One attempt: ``steps`` heartbeats, then an exit (an OOM report at ``fail`` when given)."""

    spec: AttemptSpec
    clock: FakeClock
    behaviour: str
    pid: int = 4000
    started_monotonic: float = 0.0
    _code: int | None = None

    def __post_init__(self) -> None:
        self.started_monotonic = self.clock()

    def poll(self) -> int | None:
        if self._code is None and self.clock() - self.started_monotonic >= 1.0:
            self._code = self._finish()
        return self._code

    def wait_for_exit(self, timeout_s: float, sleep: Any) -> None:
        sleep(timeout_s)

    def stop(self, grace_s: float, sleep: Any) -> int:
        return self.poll() if self._code is not None else int(ExitCode.STOPPED)

    def _finish(self) -> int:
        spec, events = self.spec, Path(self.spec.events_file)
        start = _resume_step(spec)
        name, _, at = self.behaviour.partition("@")
        last = spec.train.max_steps if name == "ok" else int(at or 1) - 1
        with events.open("a", encoding="utf-8") as out:
            for step in range(start + 1, last + 1):
                out.write(event_line("heartbeat", step=step, stage="forward", peak=GiB))
        if name == "ok":
            Path(spec.adapter_dir).mkdir(parents=True, exist_ok=True)
            with events.open("a", encoding="utf-8") as out:
                out.write(event_line("finished", step=last))
            return 0
        checkpoint = _checkpoint(spec, last) if last > start else None
        message = CONTENTION if name == "contention" else OOM
        report = ErrorReport(
            exit_code=int(ExitCode.OOM),
            exception_type="torch.OutOfMemoryError",
            message=message,
            traceback=message,
            stage="forward",
            step=max(last, start),
            is_oom=True,
            device="cuda:0",
            emergency_checkpoint=checkpoint,
        )
        Path(spec.error_file).write_text(report.to_json(), encoding="utf-8")
        return int(ExitCode.OOM)


def _resume_step(spec: AttemptSpec) -> int:
    if not spec.resume_from:
        return 0
    return int(json.loads((Path(spec.resume_from) / CHECKPOINT_COMPLETE_MARKER).read_text())["step"])


def _checkpoint(spec: AttemptSpec, step: int) -> str:
    path = Path(spec.checkpoints_dir) / f"checkpoint-{step}"
    path.mkdir(parents=True, exist_ok=True)
    marker = {"step": step, "knobs": dataclasses.asdict(spec.knobs)}
    (path / CHECKPOINT_COMPLETE_MARKER).write_text(json.dumps(marker))
    return str(path)


class FakeGpu:
    """A card where another process holds memory until ``frees_after`` polls."""

    def __init__(self, frees_after: int | None, state_path: Path) -> None:
        self.polls = 0
        self.frees_after = frees_after
        self.states_seen: list[str] = []
        self._state_path = state_path

    def sample(self, pids: set[int]) -> GpuSample:
        if not pids:
            self.polls += 1
            state = read_state(self._state_path)
            self.states_seen.append(state.run_state.value if state else "-")
        freed = self.frees_after is not None and self.polls > self.frees_after
        free = 20 * GiB if freed else 200 * 1024**2
        return GpuSample(time.time(), 0, 24 * GiB, 24 * GiB - free, free, 0, ())

    def close(self) -> None:
        pass


def _seams(clock: FakeClock, plan: Mapping[int, str], gpu: FakeGpu | None = None) -> Seams:
    def spawn(argv: Sequence[str], env: Mapping[str, str], log_path: Path, cwd: Path) -> FakeChild:
        spec = AttemptSpec.from_json(Path(argv[-1]).read_text(encoding="utf-8"))
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text("")
        return FakeChild(spec, clock, plan.get(spec.attempt, "ok"))

    return Seams(
        clock=clock,
        wall=clock,
        sleep=clock.sleep,
        spawn=spawn,
        argv=lambda spec, phase: ["fake-child", str(spec)],
        open_gpu=lambda device: gpu,
        oom_kills=lambda: None,
        tick_s=0.25,
        sample_every_s=5.0,
        stop_grace_s=1.0,
    )


def _job(tmp_path: Path, **supervise: Any) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(20)))
    job = {
        "model": {"path": "model"},
        "data": {"path": "data.jsonl"},
        "train": {
            "micro_batch_size": 4,
            "effective_batch_size": 8,
            "gradient_checkpointing": False,
            "max_steps": 10,
            "save_steps": 4,
            "max_seq_len": 256,
        },
        "resources": {"gpu": "cuda:0"},
        "supervise": {"hang_timeout": "60s", "backoff_initial": "5s", "backoff_max": "60s", **supervise},
        "output_dir": "run",
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _run(job: Path, seams: Seams) -> int:
    return run_job(str(job), plain=True, seams=seams, console=io.StringIO(), install_signals=False)


def test_a_whole_ladder_climb_runs_on_the_fake_clock(tmp_path: Path) -> None:
    """Two forward OOMs climb checkpointing then a halved micro-batch, and the third attempt finishes."""
    started = time.monotonic()
    clock = FakeClock()
    code = _run(_job(tmp_path), _seams(clock, {1: "oom@3", 2: "oom@6"}))
    assert code == 0
    records, bad = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert bad == 0 and [r.outcome.value for r in records] == ["failed", "failed", "succeeded"]
    assert [r.decision.rung for r in records[:2] if r.decision] == [
        "gradient_checkpointing",
        "halve_micro_batch",
    ]
    assert records[2].knobs.micro_batch_size == 2 and records[2].knobs.effective_batch == 8
    assert [r.resumed_from for r in records] == [0, 2, 5] and sum(r.lost_steps for r in records) == 0
    # A changed config starts at once: no backoff was slept.
    assert not [e for e in read_events(tmp_path / "run" / "events.jsonl") if e["event"] == "backoff"]
    assert time.monotonic() - started < 1.0


def test_the_contention_wait_is_written_as_waiting_and_restarts_unchanged(tmp_path: Path) -> None:
    """Memory held by another process: the state says WAITING, and the same config runs once it frees."""
    started = time.monotonic()
    clock = FakeClock()
    gpu = FakeGpu(frees_after=3, state_path=tmp_path / "run" / "state.json")
    assert _run(_job(tmp_path), _seams(clock, {1: "contention@2"}, gpu)) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    first = records[0]
    assert first.failure is not None and first.failure.kind.value == "oom_contention"
    assert first.decision is not None and first.decision.rung == "wait_for_memory"
    assert first.decision.waited_s > 0 and records[1].knobs == first.knobs
    assert RunState.WAITING.value in gpu.states_seen
    assert time.monotonic() - started < 1.0


def test_a_crash_loop_ends_in_a_verdict_on_the_fake_clock(tmp_path: Path) -> None:
    """Contention with no NVML reading restarts unchanged with backoff until the crash-loop guard stops it."""
    started = time.monotonic()
    clock = FakeClock()
    job = _job(tmp_path, max_no_progress_attempts=3)
    assert _run(job, _seams(clock, dict.fromkeys(range(1, 10), "contention@1"))) == 3
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert len(records) == 3 and all(r.steps_progressed == 0 for r in records)
    last = records[-1].decision
    assert last is not None and last.action.value == "give_up" and "crash loop" in last.why
    backoffs = [
        e["seconds"] for e in read_events(tmp_path / "run" / "events.jsonl") if e["event"] == "backoff"
    ]
    assert backoffs == [5.0, 10.0]  # unchanged retries back off, doubling
    assert time.monotonic() - started < 1.0


def test_without_a_cap_the_budget_is_the_card_less_a_reserve(tmp_path: Path) -> None:
    """Bug 2: with no gpu_memory_limit the memory model plans against NVML's total less the reserve."""
    from qlora_supervise.policies.budget import card_budget
    from qlora_supervise.supervisor.commands import run as run_mod

    clock = FakeClock()
    gpu = FakeGpu(frees_after=0, state_path=tmp_path / "run" / "state.json")
    seen: list[int | None] = []
    original = run_mod.Supervisor.run

    def spy(self: Any) -> int:
        code = original(self)
        seen.append(self.settings.budget_bytes)
        return code

    run_mod.Supervisor.run = spy  # type: ignore[method-assign]
    try:
        assert _run(_job(tmp_path), _seams(clock, {}, gpu)) == 0
    finally:
        run_mod.Supervisor.run = original  # type: ignore[method-assign]
    assert seen == [card_budget(24 * GiB)] and seen[0] is not None and 22 * GiB < seen[0] < 24 * GiB


LLAMA2_7B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}


def _ambitious_job(tmp_path: Path) -> Path:
    """seq 2048, micro-batch 4, no checkpointing, on an 8 GiB cap: predicted far over."""
    path = _job(tmp_path)
    (tmp_path / "model" / "config.json").write_text(json.dumps(LLAMA2_7B))
    job = yaml.safe_load(path.read_text())
    job["train"].update(micro_batch_size=4, effective_batch_size=16, max_seq_len=2048)
    job["resources"]["gpu_memory_limit"] = "8GiB"
    path.write_text(yaml.safe_dump(job))
    return path


def test_the_first_attempt_starts_from_the_preflight_config(tmp_path: Path) -> None:
    """An over-ambitious job starts from throughput changes predicted to fit, journaled as its plan."""
    assert _run(_ambitious_job(tmp_path), _seams(FakeClock(), {})) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    first = records[0]
    assert len(records) == 1 and first.plan is not None and not first.plan.as_written
    assert first.knobs.gradient_checkpointing and first.knobs.effective_batch == 16
    assert first.knobs.max_seq_len == 2048 and first.knobs.lora_r == 8  # no quality knob touched
    assert first.plan.budget == 8 * GiB and first.plan.predicted_peak is not None
    assert first.plan.predicted_peak <= 8 * GiB / 1.08 and not first.plan.quality_changed
    assert "gradient_checkpointing" in first.plan.changes
    events = [e for e in read_events(tmp_path / "run" / "events.jsonl") if e["event"] == "preflight"]
    assert len(events) == 1 and events[0]["budget_bytes"] == 8 * GiB


def test_as_written_keeps_the_job_config(tmp_path: Path) -> None:
    """``run --as-written`` starts from the job's own knobs and says so in the plan."""
    code = run_job(
        str(_ambitious_job(tmp_path)),
        plain=True,
        seams=_seams(FakeClock(), {}),
        console=io.StringIO(),
        install_signals=False,
        as_written=True,
    )
    assert code == 0
    first = read_attempts(tmp_path / "run" / "attempts.jsonl")[0][0]
    assert first.plan is not None and first.plan.as_written
    assert (first.knobs.micro_batch_size, first.knobs.gradient_checkpointing) == (4, False)
    assert first.plan.predicted_peak is not None and first.plan.predicted_peak > 8 * GiB


def test_the_next_run_on_this_host_starts_calibrated(tmp_path: Path) -> None:
    """Peaks a run observed are stored per host; the next run's pre-flight uses them (and can be off)."""
    from qlora_supervise.supervisor.loop.settings import model_shape
    from qlora_supervise.supervisor.record.peak_store import default_path, read_observations

    first = tmp_path / "first"
    first.mkdir()
    assert _run(_ambitious_job(first), _seams(FakeClock(), {})) == 0
    shape = model_shape(first / "model")
    assert shape is not None
    stored = read_observations(default_path(), shape)
    assert len(stored) == 1 and stored[0].peak_bytes == GiB  # the fake child's heartbeat peak
    second = tmp_path / "second"
    second.mkdir()
    assert _run(_ambitious_job(second), _seams(FakeClock(), {})) == 0
    plan = read_attempts(second / "run" / "attempts.jsonl")[0][0].plan
    assert plan is not None and any("seen on this host" in why for why in plan.why)
    off = tmp_path / "off"
    off.mkdir()
    job = _ambitious_job(off)
    raw = yaml.safe_load(job.read_text())
    raw["supervise"]["calibration_store"] = False
    job.write_text(yaml.safe_dump(raw))
    assert _run(job, _seams(FakeClock(), {})) == 0
    plan = read_attempts(off / "run" / "attempts.jsonl")[0][0].plan
    assert plan is not None and not any("seen on this host" in why for why in plan.why)
    assert len(read_observations(default_path(), shape)) == 2  # the third run stored nothing
