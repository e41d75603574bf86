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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from qlora_supervise.supervisor.commands.explain import explanation
from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.loop.child import Seams
from qlora_supervise.supervisor.record.eventlog import read_events
from qlora_supervise.supervisor.record.journal import RunState, read_attempts, read_state
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.supervisor.watching.gpu import GpuProbe, GpuSample
from qlora_supervise.trainer_child.contract.checkpoints import CHECKPOINT_COMPLETE_MARKER
from qlora_supervise.trainer_child.contract.codes import ExitCode
from qlora_supervise.trainer_child.contract.events import SpeedTrialEvent, TrialResult, event_line
from qlora_supervise.trainer_child.contract.report import ErrorReport
from qlora_supervise.trainer_child.contract.spec import AttemptSpec, TrialCandidate, rank_file

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
    """One attempt, as the scripted child's behaviours (``name@N``: at step N), on the fake clock.

    After one fake second it has trained up to step N-1 and then: ``ok`` finishes; ``oom@N`` /
    ``oom_backward@N`` / ``contention@N`` exit with an OOM report and an emergency checkpoint;
    ``killed@N`` dies of SIGKILL with no report; ``config_error`` reports a config error at load;
    ``hang@N`` stops making progress until it is stopped, then checkpoints and exits STOPPED;
    ``rank_left@N`` (two ranks): rank 1 reports an OOM, rank 0 stays stuck until it is killed.
    """

    spec: AttemptSpec
    clock: FakeClock
    behaviour: str
    pid: int = 4000
    started_monotonic: float = 0.0
    _code: int | None = None

    def __post_init__(self) -> None:
        self.started_monotonic = self.clock()

    def poll(self) -> int | None:
        if self._code is None and self._hung_at is None and self.clock() - self.started_monotonic >= 1.0:
            self._code = self._finish()
        return self._code

    def wait_for_exit(self, timeout_s: float, sleep: Any) -> None:
        sleep(timeout_s)

    def stop(self, grace_s: float) -> int:
        if self._code is None and self.behaviour.startswith("rank_left"):
            self._code = -9  # stuck in the broken collective: it ignores SIGTERM and is killed
        if self._code is None and self._hung_at is not None:
            last = self._hung_at  # SIGTERM: like the real trainer, checkpoint and leave
            if last > _resume_step(self.spec):
                _checkpoint(self.spec, last)
            self._code = int(ExitCode.STOPPED)
        return self._code if self._code is not None else int(ExitCode.STOPPED)

    _hung_at: int | None = None

    def _finish(self) -> int | None:
        spec, events = self.spec, Path(self.spec.events_file)
        start = _resume_step(spec)
        name, _, at = self.behaviour.partition("@")
        if name == "config_error":
            return self._report(
                "load", ExitCode.CONFIG, "ConfigError", "target_modules ['q'] matched no layer", None
            )
        if name.startswith("trial+"):  # a speed trial that switched to half the micro-batch first
            name = name.removeprefix("trial+")
            _switched_trial(spec, events)
        last = spec.train.max_steps if name == "ok" else int(at or 1) - 1
        with events.open("a", encoding="utf-8") as out:
            for step in range(start + 1, last + 1):
                out.write(event_line("heartbeat", step=step, stage="forward", peak_bytes=GiB))
        if name in ("hang", "rank_left"):
            self._hung_at = max(last, start)
            if name == "rank_left":
                self._rank1_oom(last)
            return None
        if name == "killed":
            return -9
        if name == "ok":
            Path(spec.adapter_dir).mkdir(parents=True, exist_ok=True)
            with events.open("a", encoding="utf-8") as out:
                out.write(event_line("finished", step=last))
            return 0
        checkpoint = _checkpoint(spec, last) if last > start else None
        message = CONTENTION if name == "contention" else OOM
        stage = "backward" if name == "oom_backward" else "forward"
        return self._report(stage, ExitCode.OOM, "torch.OutOfMemoryError", message, checkpoint)

    def _report(self, stage: str, code: ExitCode, exc: str, message: str, checkpoint: str | None) -> int:
        report = ErrorReport(
            exit_code=int(code),
            exception_type=exc,
            message=message,
            traceback=message,
            stage=stage,
            step=max(self._steps_done(), _resume_step(self.spec)),
            is_oom=code is ExitCode.OOM,
            config_error=code is ExitCode.CONFIG,
            device="cuda:0",
            emergency_checkpoint=checkpoint,
        )
        Path(self.spec.error_file).write_text(report.to_json(), encoding="utf-8")
        return int(code)

    def _rank1_oom(self, step: int) -> None:
        report = ErrorReport(
            exit_code=int(ExitCode.OOM), exception_type="torch.OutOfMemoryError", message=OOM, traceback=OOM,
            stage="forward", step=step, is_oom=True, device="cuda:1", rank=1, local_rank=1, world_size=2,
        )  # fmt: skip
        Path(rank_file(self.spec.error_file, 1)).write_text(report.to_json(), encoding="utf-8")

    def _steps_done(self) -> int:
        _, _, at = self.behaviour.partition("@")
        return int(at) - 1 if at else 0


def _switched_trial(spec: AttemptSpec, events: Path) -> None:
    k = spec.knobs
    planned = TrialCandidate(k.micro_batch_size, k.grad_accum, k.gradient_checkpointing)
    half = TrialCandidate(k.micro_batch_size // 2, k.grad_accum * 2, not k.gradient_checkpointing)
    rows = (TrialResult(planned, 100.0, GiB, 1.0), TrialResult(half, 150.0, GiB, 1.0))
    with events.open("a", encoding="utf-8") as out:
        out.write(SpeedTrialEvent(rows, 2.0).to_line())


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


def _seams(
    clock: FakeClock,
    plan: Mapping[int, str],
    gpu: GpuProbe | None = None,
    default: str = "ok",
    *,
    child: Callable[[AttemptSpec, FakeClock, str], Any] | None = None,
    sample_every_s: float = 5.0,
) -> Seams:
    """The loop's seams on the fake clock: attempt N is ``child(spec, clock, plan[N])``; ``child``
    defaults to this module's ``FakeChild`` as it is when the attempt starts (tests patch it)."""

    def spawn(argv: Sequence[str], env: Mapping[str, str], log_path: Path, cwd: Path) -> Any:
        spec = AttemptSpec.from_json(Path(argv[-1]).read_text(encoding="utf-8"))
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text("")
        return (child or FakeChild)(spec, clock, plan.get(spec.attempt, default))

    return Seams(
        clock=clock,
        wall=clock,
        sleep=clock.sleep,
        spawn=spawn,
        argv=lambda spec, phase: ["fake-child", str(spec)],
        open_gpu=lambda device: gpu,
        oom_kills=lambda: None,
        tick_s=0.25,
        sample_every_s=sample_every_s,
        stop_grace_s=1.0,
    )


def _job(tmp_path: Path, resources: Mapping[str, Any] | None = None, **supervise: Any) -> Path:
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
        "resources": dict(resources or {"gpu": "cuda:0"}),
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
    from qlora_supervise.policies.search.budget import card_budget
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


def test_the_policy_sees_the_peak_of_the_attempt_that_just_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failed attempt reaches ``policies.decide`` with the peak its journal line records."""
    from qlora_supervise.policies import decide as policy

    seen: list[policy.PastAttempt] = []
    original = policy.decide

    def spy(failure: Any, knobs: Any, history: Sequence[policy.PastAttempt], *args: Any, **kw: Any) -> Any:
        seen.append(history[-1])
        return original(failure, knobs, history, *args, **kw)

    monkeypatch.setattr(policy, "decide", spy)
    assert _run(_job(tmp_path), _seams(FakeClock(), {1: "oom@3"})) == 0
    failed = read_attempts(tmp_path / "run" / "attempts.jsonl")[0][0]
    assert failed.peak is not None and failed.peak.bytes > 0 and failed.steps_progressed == 2
    assert [past.peak_bytes for past in seen] == [failed.peak.bytes]
    assert seen[0].steps_progressed == failed.steps_progressed and seen[0].knobs == failed.knobs


def test_an_attempt_the_speed_trial_switched_is_journaled_with_the_knobs_it_trained(tmp_path: Path) -> None:
    """The trial halved the micro-batch and flipped checkpointing, then the attempt OOMed: its journal
    line, and the config the ladder climbs from, are the trained knobs, not the planned ones."""
    assert _run(_job(tmp_path), _seams(FakeClock(), {1: "trial+oom@3"})) == 0
    first, second, *_ = read_attempts(tmp_path / "run" / "attempts.jsonl")[0]
    planned = json.loads((tmp_path / "run" / "attempt-001" / "spec.json").read_text())["knobs"]
    assert first.knobs.micro_batch_size == planned["micro_batch_size"] // 2
    assert first.knobs.gradient_checkpointing is not planned["gradient_checkpointing"]
    assert first.knobs.effective_batch == planned["micro_batch_size"] * planned["grad_accum"]
    assert first.decision is not None and first.decision.knobs == second.knobs
    assert second.knobs != first.knobs
    # The policy chose among the reported timings, and explain says so in its words.
    why = explanation(RunDir(tmp_path / "run"))["attempts"][0]["why"][-1]
    assert why.startswith("speed trial: micro-batch") and "50% faster than the plan" in why


def _states_written(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every state the arbiter writes to state.json, in order (the arbiter is its one writer)."""
    from qlora_supervise.supervisor.loop import arbiter

    written: list[str] = []
    original = arbiter.write_state

    def spy(path: Path, state: Any) -> None:
        written.append(state.run_state.value)
        original(path, state)

    monkeypatch.setattr(arbiter, "write_state", spy)
    return written


def test_the_arbiter_moves_the_state_through_waiting_and_backoff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A contention wait, an unchanged retry's backoff, the verdict: states the arbiter writes, in order."""
    written = _states_written(monkeypatch)
    gpu = FakeGpu(frees_after=3, state_path=tmp_path / "run" / "state.json")
    assert _run(_job(tmp_path), _seams(FakeClock(), {1: "contention@2", 2: "killed@4"}, gpu)) == 0
    # in flight before and after each spawn; WAITING for memory; BACKOFF before the unchanged retry of 2
    assert written == [
        *["running", "running", "waiting"],
        *["running", "running", "backoff"],
        *["running", "running", "succeeded"],
    ]
    assert read_state(tmp_path / "run" / "state.json").run_state is RunState.SUCCEEDED  # type: ignore[union-attr]


def test_second_forward_oom_halves_micro_batch_keeping_effective_batch(tmp_path: Path) -> None:
    """Two forward OOMs climb to the second rung: half the micro-batch, twice the accumulation."""
    assert _run(_job(tmp_path), _seams(FakeClock(), {1: "oom@2", 2: "oom@5"})) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    third = records[2]
    assert (third.knobs.micro_batch_size, third.knobs.grad_accum) == (2, 4)
    assert third.knobs.gradient_checkpointing is True
    assert sum(r.lost_steps for r in records) == 0


def test_ladder_exhausted_gives_up_with_exit_3(tmp_path: Path) -> None:
    """When every rung has been tried the supervisor gives up with exit 3 and says why."""
    job = _job(tmp_path, max_no_progress_attempts=20, max_attempts=20)
    assert _run(job, _seams(FakeClock(), {}, default="oom@1")) == 3
    gave_up = _events(tmp_path, "gave_up")[0]
    assert "exhausted" in gave_up["why"]
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    configs = [r.knobs for r in records]
    assert len(configs) == len(set(configs)), "a config that failed the same way was repeated"


def test_crash_loop_protection(tmp_path: Path) -> None:
    """Unchanged restarts that train no step (memory taken again at once) stop the run: a crash loop."""
    job = _job(tmp_path, max_no_progress_attempts=3, max_attempts=20)
    gpu = FakeGpu(frees_after=0, state_path=tmp_path / "run" / "state.json")
    assert _run(job, _seams(FakeClock(), {}, gpu, default="contention@1")) == 3
    assert "crash loop" in _events(tmp_path, "gave_up")[0]["why"]
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert len(records) == 3


def test_ladder_climbing_at_step_zero_is_not_a_crash_loop(tmp_path: Path) -> None:
    """OOMs at the first step that each change the config climb the whole ladder before giving up."""
    job = _job(tmp_path, max_no_progress_attempts=2, max_attempts=20)
    assert _run(job, _seams(FakeClock(), {}, default="oom@1")) == 3
    assert "exhausted" in _events(tmp_path, "gave_up")[0]["why"]


def test_contention_that_does_not_clear_gives_up_without_degrading(tmp_path: Path) -> None:
    """When the other process keeps the memory past contention_wait, the run gives up (exit 3)."""
    started = time.monotonic()
    job = _job(tmp_path, contention_wait="30m")  # half an hour, on the fake clock
    gpu = FakeGpu(frees_after=None, state_path=tmp_path / "run" / "state.json")
    assert _run(job, _seams(FakeClock(), {1: "contention@3"}, gpu)) == 3
    gave_up = _events(tmp_path, "gave_up")[0]
    assert "degrade_on_contention" in gave_up["why"]
    decision = read_attempts(tmp_path / "run" / "attempts.jsonl")[0][0].decision
    assert decision is not None and decision.waited_s == 1800.0
    assert _events(tmp_path, "memory_wait_timed_out") and time.monotonic() - started < 5.0


def test_contention_degrades_when_the_job_allows_it(tmp_path: Path) -> None:
    """With degrade_on_contention the stage's ladder is used instead of waiting."""
    job = _job(tmp_path, degrade_on_contention=True)
    gpu = FakeGpu(frees_after=None, state_path=tmp_path / "run" / "state.json")
    assert _run(job, _seams(FakeClock(), {1: "contention@3"}, gpu)) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert records[0].decision is not None and records[0].decision.rung == "gradient_checkpointing"


def test_leftover_attempt_directory_is_moved_aside_not_trusted(tmp_path: Path) -> None:
    """An attempt directory the journal never recorded (with a stale error report) is moved aside."""
    job = _job(tmp_path)
    stale = tmp_path / "run" / "attempt-001"
    stale.mkdir(parents=True)
    # A run of ours (its first event written): a folder of only a leftover is no run of ours.
    (tmp_path / "run" / "events.jsonl").write_text('{"event": "run_started", "level": "info"}\n')
    (stale / "error.json").write_text('{"exit_code": 70, "stage": "forward"}')
    assert _run(job, _seams(FakeClock(), {})) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert [r.outcome for r in records] == ["succeeded"]
    assert not (tmp_path / "run" / "attempt-001" / "error.json").exists()
    assert list((tmp_path / "run").glob("attempt-001.unrecorded-*/error.json"))


def test_a_hang_that_repeats_gives_up_instead_of_looking_like_a_stop(tmp_path: Path) -> None:
    """A hung child that checkpoints and exits on our SIGTERM is a hang, not a user stop (exit 3, not 143)."""
    started = time.monotonic()
    assert _run(_job(tmp_path, hang_timeout="10m"), _seams(FakeClock(), {}, default="hang@2")) == 3
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    # Retried until it repeated with no step trained in between as often as the crash-loop limit.
    assert [r.failure.kind for r in records if r.failure] == ["hang", "hang", "hang"]
    assert read_state(tmp_path / "run" / "state.json").run_state.value == "gave_up"  # type: ignore[union-attr]
    assert len(_events(tmp_path, "hang_detected")) == 3 and time.monotonic() - started < 5.0


def test_torn_journal_line_does_not_swallow_the_next_record(tmp_path: Path) -> None:
    """A line torn by a kill stays one unreadable line; the records after it are kept."""
    assert _run(_job(tmp_path), _seams(FakeClock(), {1: "oom@3"})) == 0
    journal = tmp_path / "run" / "attempts.jsonl"
    first = journal.read_text().splitlines()[0]
    journal.write_text(first + "\n" + first[: len(first) // 2])  # attempt 2's line torn mid-write
    from qlora_supervise.supervisor.record.journal import AttemptRecord, append_attempt

    append_attempt(journal, AttemptRecord.from_json({**json.loads(first), "attempt": 3}))
    records, bad = read_attempts(journal)
    assert [r.attempt for r in records] == [1, 3] and bad == 1


def test_trainer_deaths_without_progress_between_still_give_up(tmp_path: Path) -> None:
    """Issue 11 item 1: the crash-loop guard stays: retries that keep dying before any new step give up
    (one early death, as a preemption during the next load, is still retried)."""
    assert _run(_job(tmp_path), _seams(FakeClock(), {1: "killed@3"}, default="killed@1")) == 3
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert len(records) == 3 and [r.steps_progressed for r in records[1:]] == [0, 0]
    assert "no step trained in between" in _events(tmp_path, "gave_up")[0]["why"]


def _events(tmp_path: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in read_events(tmp_path / "run" / "events.jsonl") if e["event"] == name]


def test_ranks_left_after_one_ranks_failure_are_stopped_after_the_bound_not_the_hang_timeout(
    tmp_path: Path,
) -> None:
    """Rank 1 reported an OOM and rank 0 stays stuck: 30 s later it is stopped, the OOM is judged."""
    clock = FakeClock()
    job = _job(tmp_path, {"gpu": "auto", "nproc_per_node": 2}, hang_timeout="10m")
    assert _run(job, _seams(clock, {1: "rank_left@3"})) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    first = records[0]
    assert first.failure is not None and first.failure.kind.value == "oom_forward" and first.failure.rank == 1
    bounded = [
        e for e in read_events(tmp_path / "run" / "events.jsonl") if e["event"] == "ranks_shutdown_bounded"
    ]
    assert len(bounded) == 1 and 30 <= bounded[0]["waited_s"] < 32 and bounded[0]["reported"] == [1]
    assert records[1].outcome.value == "succeeded" and records[1].knobs.world_size == 2
