"""Stepping back up on the fake clock (issue 34): whole runs whose rung's cause clears mid-attempt.

A fake child trains one step a fake second, saves a checkpoint every ``save_steps``, fails where
its script says (an OOM message naming contention, fragmentation, a spurious request or a long
sample) and, stopped, checkpoints and exits like the real trainer. A fake card's other processes
hold memory along a timeline of fake seconds, so the loop's real runner, climb-back watch, policy,
journal and planner run.
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from test_loop_fake_clock import CONTENTION, LLAMA2_7B, FakeClock, GiB, _checkpoint, _job, _resume_step, _run
from test_loop_fake_clock import _seams as fake_seams

from qlora_supervise.supervisor.commands.explain import explanation, print_table
from qlora_supervise.supervisor.commands.status import print_story, status_json
from qlora_supervise.supervisor.loop.child import Seams
from qlora_supervise.supervisor.loop.climb_back import remaining_s
from qlora_supervise.supervisor.record.eventlog import read_events
from qlora_supervise.supervisor.record.journal import AttemptRecord, read_attempts
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.supervisor.watching.gpu import GpuSample
from qlora_supervise.supervisor.watching.watch import Progress
from qlora_supervise.trainer_child.contract.codes import ExitCode
from qlora_supervise.trainer_child.contract.events import Heartbeat, SpeedTrialEvent, TrialResult, event_line
from qlora_supervise.trainer_child.contract.report import ErrorReport
from qlora_supervise.trainer_child.contract.spec import AttemptSpec, Knobs

FRAGMENTED = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
    "of 23.55 GiB of which 1.10 GiB is free. Including non-PyTorch memory, this process has 22.44 GiB "
    "memory in use. Of the allocated memory 14.00 GiB is allocated by PyTorch, and 8.00 GiB is reserved "
    "by PyTorch but unallocated."
)
PLAIN_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
    "of 23.55 GiB of which 1.10 GiB is free. Including non-PyTorch memory, this process has 22.44 GiB "
    "memory in use. Of the allocated memory 21.90 GiB is allocated by PyTorch, and 120.00 MiB is reserved "
    "by PyTorch but unallocated."
)
MESSAGES = {"contention": CONTENTION, "fragmentation": FRAGMENTED, "oom": PLAIN_OOM, "long": PLAIN_OOM}


@dataclasses.dataclass
class SteppingChild:
    """One attempt: a step a fake second from its resume step; ``kind@N`` fails in step N; ``pickI``
    runs the spec's speed trial (when it asks for one) and trains its candidate I."""

    spec: AttemptSpec
    clock: FakeClock
    script: str
    pid: int = 4000
    started_monotonic: float = 0.0
    done: int = 0
    code: int | None = None
    finished_at: float | None = None

    def __post_init__(self) -> None:
        self.started_monotonic = self.clock()
        self.done = _resume_step(self.spec)
        lengths = {"rows": 100, "lengths": [60] * 99 + [4000]}  # one long sample in a hundred
        self._write("loaded", sample_lengths=lengths)
        spec = self.spec
        from_here = not spec.resume_from or spec.speed_trial_on_resume
        if self.script.startswith("pick") and len(spec.speed_trial) >= 2 and from_here:
            self._trial(int(self.script.removeprefix("pick")))

    def _trial(self, index: int) -> None:
        candidates = self.spec.speed_trial
        rows = [TrialResult(c, 1000.0 if i == index else 500.0, GiB, 1.0) for i, c in enumerate(candidates)]
        chosen = candidates[index]  # the policy's choice among these timings (the fastest by far)
        event = SpeedTrialEvent(tuple(rows), 2.0)
        with Path(self.spec.events_file).open("a", encoding="utf-8") as out:
            out.write(event.to_line())
        self.spec = dataclasses.replace(
            self.spec,
            knobs=dataclasses.replace(
                self.spec.knobs,
                micro_batch_size=chosen.micro_batch_size,
                grad_accum=chosen.grad_accum,
                gradient_checkpointing=chosen.gradient_checkpointing,
            ),
        )

    def poll(self) -> int | None:
        if self.code is None:
            self._advance()
        return self.code

    def wait_for_exit(self, timeout_s: float, sleep: Callable[[float], None]) -> None:
        sleep(timeout_s)

    def stop(self, grace_s: float) -> int:
        if self.code is None:  # SIGTERM: finish, checkpoint, leave
            if self.done > _resume_step(self.spec):
                self._save(self.done)
            self.code = int(ExitCode.STOPPED)
        return self.code

    def _advance(self) -> None:
        kind, _, at = self.script.partition("@")
        fail_at = int(at) if at else None
        target = _resume_step(self.spec) + int(self.clock() - self.started_monotonic)
        k = self.spec.knobs
        peak = (3 if k.gradient_checkpointing or k.micro_batch_size < 4 else 15) * GiB
        while self.done < min(target, self.spec.train.max_steps):
            step = self.done + 1
            if fail_at is not None and step == fail_at:
                self.code = self._fail(kind, step)
                return
            # Stamped as full-length rows at 100 tokens/s take: the time left is read from the stamps.
            stamp = (
                self.started_monotonic
                + (step - _resume_step(self.spec)) * k.micro_batch_size * k.grad_accum * k.max_seq_len / 100.0
            )
            self._write(
                "heartbeat", step=step, stage="forward", tokens_per_s=100.0, peak_bytes=peak, time=stamp
            )
            self.done = step
            if step % self.spec.train.save_steps == 0:
                self._save(step)
        if self.done >= self.spec.train.max_steps and self.finished_at is None:
            Path(self.spec.adapter_dir).mkdir(parents=True, exist_ok=True)
            self._write("finished", step=self.done)
            self.finished_at = self.clock()
        if self.finished_at is not None and self.clock() - self.finished_at >= 1.0:
            self.code = 0  # a second after its last save, as the real child saves the adapter and exits

    def _save(self, step: int) -> None:
        self._write("checkpoint_saved", step=step, path=_checkpoint(self.spec, step))

    def _write(self, event: str, **fields: Any) -> None:
        with Path(self.spec.events_file).open("a", encoding="utf-8") as out:
            out.write(event_line(event, **fields))

    def _fail(self, kind: str, step: int) -> int:
        checkpoint = self._save_emergency()
        lengths = [4000, 60] if kind == "long" else [60, 60]
        batch = {"step": step, "micro": 0, "lengths": lengths}
        report = ErrorReport(
            exit_code=int(ExitCode.OOM),
            exception_type="torch.OutOfMemoryError",
            message=MESSAGES[kind],
            traceback=MESSAGES[kind],
            stage="forward",
            step=self.done,
            is_oom=True,
            device="cuda:0",
            emergency_checkpoint=checkpoint,
            batch=batch,  # type: ignore[arg-type]  # pydantic reads the plain dict as the report file does
        )
        Path(self.spec.error_file).write_text(report.to_json(), encoding="utf-8")
        return int(ExitCode.OOM)

    def _save_emergency(self) -> str | None:
        return _checkpoint(self.spec, self.done) if self.done > _resume_step(self.spec) else None


Utilisation = Callable[[float], int | None] | None


class SharedCard:
    """A 24 GiB card whose other process holds ``others(t)`` bytes at fake time ``t`` and uses
    ``util(t)`` % of the SMs (None: the board does not say)."""

    def __init__(
        self,
        clock: FakeClock,
        others: Callable[[float], int],
        util: Callable[[float], int | None] = lambda t: None,
    ) -> None:
        self.clock, self.others, self.util = clock, others, util

    def sample(self, pids: set[int]) -> GpuSample:
        held = self.others(self.clock())
        free = 24 * GiB - held - (3 * GiB if pids else 0)
        listed = ((4242, held),) if held else ()
        return GpuSample(
            self.clock(), 0, 24 * GiB, 24 * GiB - free, free, 0, listed, (), self.util(self.clock())
        )

    def close(self) -> None:
        pass


def _seams(clock: FakeClock, scripts: Mapping[int, str], card: SharedCard) -> Seams:
    return fake_seams(clock, scripts, card, child=SteppingChild, sample_every_s=1.0)


def _job_at(tmp_path: Path, **supervise: Any) -> Path:
    settings = {"degrade_on_contention": True, "step_up_settle": "10s", "speed_trial": False, **supervise}
    job = _job(tmp_path, **settings)
    raw = job.read_text().replace("max_steps: 10", "max_steps: 40")
    job.write_text(raw)
    return job


def _records(tmp_path: Path) -> list[AttemptRecord]:
    records, bad = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert bad == 0
    return records


def _events(tmp_path: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in read_events(tmp_path / "run" / "events.jsonl") if e["event"] == name]


def _gone_after(seconds: float, held: int = 18 * GiB) -> Callable[[float], int]:
    start = FakeClock().now
    return lambda t: held if t - start < seconds else 0


def test_contention_gone_steps_up_at_the_next_checkpoint(tmp_path: Path) -> None:
    """Another process takes the card, the run degrades, and once its memory is gone for the settle
    time the next checkpoint restarts in the config before the rung, journaled as a step-up."""
    clock = FakeClock()
    card = SharedCard(clock, _gone_after(25))
    assert _run(_job_at(tmp_path), _seams(clock, {1: "contention@3"}, card)) == 0
    records = _records(tmp_path)
    assert [r.outcome.value for r in records] == ["failed", "stepped_up", "succeeded"]
    assert records[0].failure is not None and records[0].failure.kind.value == "oom_contention"
    degraded, up = records[1], records[1].decision
    assert up is not None and up.rung == "step_up" and up.undoes == 1 and "contention cleared" in up.why
    assert up.knobs == records[0].knobs != degraded.knobs and records[2].knobs == records[0].knobs
    # Stopped at a checkpoint at or after the others left plus the settle time, nothing lost.
    assert degraded.steps_completed % 4 == 0 and degraded.lost_steps == 0
    assert records[2].resumed_from == degraded.steps_completed
    assert _events(tmp_path, "step_up")[0]["undoes_attempt"] == 1


def test_contention_that_stays_never_steps_up(tmp_path: Path) -> None:
    """While the other process keeps its memory, the degraded config trains to the end, and no
    refusal is logged: the cause has not cleared."""
    clock = FakeClock()
    card = SharedCard(clock, lambda t: 18 * GiB)
    assert _run(_job_at(tmp_path), _seams(clock, {1: "contention@3"}, card)) == 0
    assert [r.outcome.value for r in _records(tmp_path)] == ["failed", "succeeded"]
    assert not _events(tmp_path, "step_up_refused")


def test_no_step_up_without_the_margin(tmp_path: Path) -> None:
    """The other process gives back most of its memory but leaves less room than the faster config's
    measured peak (15 GiB) needs with the margin: the step-up is refused and said once, and the
    degraded config finishes."""
    clock = FakeClock()
    card = SharedCard(clock, lambda t: 18 * GiB if t - 1000.0 < 25 else 8 * GiB)
    assert _run(_job_at(tmp_path), _seams(clock, {1: "contention@3"}, card)) == 0
    assert [r.outcome.value for r in _records(tmp_path)] == ["failed", "succeeded"]
    refused = _events(tmp_path, "step_up_refused")
    assert len(refused) == 1 and "does not fit" in refused[0]["why"] and "margin" in refused[0]["why"]


def test_no_step_up_after_a_failed_step_up(tmp_path: Path) -> None:
    """A step-up whose config then fails again is not tried a second time: the run climbs down and
    finishes in the degraded config."""
    clock = FakeClock()
    taken_twice = _gone_after(25)
    card = SharedCard(clock, taken_twice)
    scripts = {1: "contention@3", 3: "contention@38"}
    assert _run(_job_at(tmp_path), _seams(clock, scripts, card)) == 0
    records = _records(tmp_path)
    assert [r.outcome.value for r in records] == ["failed", "stepped_up", "failed", "succeeded"]
    assert records[3].knobs == records[1].knobs  # back down, and it stays there
    assert len(_events(tmp_path, "step_up")) == 1


@pytest.mark.parametrize(("kind", "cause"), [("fragmentation", "transient"), ("long", "long_sample")])
def test_a_transient_cause_steps_up_once_past_the_failed_step(tmp_path: Path, kind: str, cause: str) -> None:
    """Fragmentation and a long sample clear once the slower config has trained past the step that
    failed: the next checkpoint steps back up, and only once for that cause."""
    clock = FakeClock()
    card = SharedCard(clock, lambda t: 0)
    assert _run(_job_at(tmp_path), _seams(clock, {1: f"{kind}@3"}, card)) == 0
    records = _records(tmp_path)
    assert records[1].decision is not None and records[1].decision.rung == "step_up"
    assert f"{cause} cleared" in records[1].decision.why
    assert [r.outcome.value for r in records][-1] == "succeeded"
    assert len(_events(tmp_path, "step_up")) == 1


def test_a_plain_oom_is_no_cause_to_step_up(tmp_path: Path) -> None:
    """An OOM that says the config does not fit (no contention, fragmentation or long sample) keeps
    its rung for the rest of the run."""
    clock = FakeClock()
    card = SharedCard(clock, lambda t: 0)
    assert _run(_job_at(tmp_path), _seams(clock, {1: "oom@3"}, card)) == 0
    assert [r.outcome.value for r in _records(tmp_path)] == ["failed", "succeeded"]


def test_step_up_off_keeps_the_rung(tmp_path: Path) -> None:
    """``supervise.step_up: false``: the run stays in the degraded config."""
    clock = FakeClock()
    card = SharedCard(clock, _gone_after(25))
    assert _run(_job_at(tmp_path, step_up=False), _seams(clock, {1: "contention@3"}, card)) == 0
    assert [r.outcome.value for r in _records(tmp_path)] == ["failed", "succeeded"]


@pytest.mark.parametrize("allowed", [False, True])
def test_a_quality_rung_is_stepped_up_only_when_the_job_allows_it(tmp_path: Path, allowed: bool) -> None:
    """A contention rung that shortened max_seq_len is not undone unless supervise.step_up_quality
    says so: refused (and said) without it, stepped up with it."""
    clock = FakeClock()
    card = SharedCard(clock, _gone_after(25))
    ladders = {"oom_contention": ["shorten_seq_len"]}
    job = _job_at(tmp_path, ladders=ladders, step_up_quality=allowed)
    assert _run(job, _seams(clock, {1: "contention@3"}, card)) == 0
    records = _records(tmp_path)
    assert records[1].knobs.max_seq_len == records[0].knobs.max_seq_len // 2
    if allowed:
        assert records[1].decision is not None and records[1].decision.rung == "step_up"
        assert records[2].knobs.max_seq_len == records[0].knobs.max_seq_len
    else:
        assert [r.outcome.value for r in records] == ["failed", "succeeded"]
        assert "quality" in _events(tmp_path, "step_up_refused")[0]["why"]


def test_a_trial_timed_beside_neighbours_is_timed_again_once_they_leave(tmp_path: Path) -> None:
    """The speed trial chose a candidate slower than the pre-flight's while another process shared
    the card; once the card's sharing has changed for the settle time, the next checkpoint restarts
    with the pre-flight's config and the trial runs again on the resume."""
    clock = FakeClock()
    card = SharedCard(clock, _gone_after(8, held=8 * GiB))
    job = _job_at(tmp_path, speed_trial=True, calibration_store=False)
    (tmp_path / "model" / "config.json").write_text(json.dumps(LLAMA2_7B))
    # The trial beside the neighbour chose the candidate the throughput model ranks slowest.
    assert _run(job, _seams(clock, {1: "pick2", 2: "pick0"}, card)) == 0
    records = _records(tmp_path)
    assert [r.outcome.value for r in records] == ["stepped_up", "succeeded"]
    first, retimed = records
    assert first.decision is not None and first.decision.rung == "retime"
    assert "sharing changed" in first.decision.why and first.plan is not None
    assert retimed.knobs != first.knobs and retimed.resumed_from == first.steps_completed > 0
    spec = AttemptSpec.from_json((tmp_path / "run" / "attempt-002" / "spec.json").read_text())
    assert spec.speed_trial_on_resume and len(spec.speed_trial) >= 2
    assert retimed.knobs.micro_batch_size == spec.speed_trial[0].micro_batch_size


def test_a_trial_is_not_timed_again_while_the_sharing_stays(tmp_path: Path) -> None:
    """The same neighbour all run long: the trial's choice stands."""
    clock = FakeClock()
    card = SharedCard(clock, lambda t: 8 * GiB)
    job = _job_at(tmp_path, speed_trial=True, calibration_store=False)
    (tmp_path / "model" / "config.json").write_text(json.dumps(LLAMA2_7B))
    assert _run(job, _seams(clock, {1: "pick2"}, card)) == 0
    assert [r.outcome.value for r in _records(tmp_path)] == ["succeeded"]


def test_status_explain_and_the_metrics_show_the_step_up(tmp_path: Path) -> None:
    """status and explain list the step-ups and the time spent in each config; the metrics textfile
    counts the planned restart by kind."""
    clock = FakeClock()
    card = SharedCard(clock, _gone_after(25))
    prom = tmp_path / "metrics" / "run.prom"
    assert _run(_job_at(tmp_path, metrics_textfile=str(prom)), _seams(clock, {1: "contention@3"}, card)) == 0
    rd = RunDir(tmp_path / "run")
    status = status_json(rd)
    assert status["planned_restarts"] == {"step_up": 1, "retime": 0}
    configs = status["time_in_configs"]
    assert (
        len(configs) == 2
        and sum(c["steps"] for c in configs) == 40
        and "grad_ckpt on" in configs[1]["config"]
    )
    text = io.StringIO()
    print_story(rd, text)
    assert "step-ups: 1, speed trials timed again: 0\ntime in each config:" in text.getvalue()
    table = io.StringIO()
    print_table(explanation(rd), table)
    assert "step-ups: 1" in table.getvalue() and explanation(rd)["time_in_configs"] == configs
    assert 'qlora_supervise_planned_restarts_total{kind="step_up",run="run"} 1.0' in prom.read_text()


def test_a_neighbour_that_only_computes_is_seen_by_its_utilisation(tmp_path: Path) -> None:
    """A neighbour that holds no memory but kept 90 % of the SMs busy through the trial: once it
    stops for the settle time, the trial is timed again."""
    clock = FakeClock()
    card = SharedCard(clock, lambda t: 0, lambda t: 90 if t - 1000.0 < 8 else 0)
    job = _job_at(tmp_path, speed_trial=True, calibration_store=False)
    (tmp_path / "model" / "config.json").write_text(json.dumps(LLAMA2_7B))
    assert _run(job, _seams(clock, {1: "pick2", 2: "pick0"}, card)) == 0
    first = _records(tmp_path)[0]
    assert first.decision is not None and first.decision.rung == "retime"
    assert "90 % of the SMs at the trial" in first.decision.why


def test_no_step_up_at_the_final_checkpoint(tmp_path: Path) -> None:
    """A cause that clears only by the last checkpoint changes nothing: the run just finishes."""
    clock = FakeClock()
    card = SharedCard(clock, _gone_after(29))
    assert _run(_job_at(tmp_path), _seams(clock, {1: "contention@3"}, card)) == 0
    assert [r.outcome.value for r in _records(tmp_path)] == ["failed", "succeeded"]
    assert not _events(tmp_path, "step_up")


def test_the_time_left_counts_measured_seconds_per_step_not_full_length_rows() -> None:
    """Rows far shorter than max_seq_len make tokens/s low per full-length step: the time left comes
    from the heartbeats' seconds per step (after the first step, so the load is not in it)."""
    knobs = Knobs(model="m", micro_batch_size=4, grad_accum=2, max_seq_len=1024)
    beats = [Heartbeat(stage="forward", step=s, time=t) for s, t in [(0, 0.0), (1, 50.0), (11, 70.0)]]
    progress = Progress(step=11, tokens_per_s=1000.0, max_steps=111, events=list(beats))
    assert remaining_s(progress, knobs) == pytest.approx(100 * 2.0)  # 2 s a step, load left out
    no_beats = Progress(step=11, tokens_per_s=1000.0, max_steps=111)
    assert remaining_s(no_beats, knobs) == pytest.approx(100 * 8 * 1024 / 1000.0)
