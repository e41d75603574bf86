"""Two ranks through torchrun (gloo, CPU) on the tiny model: one rank's real OOM, the emergency
checkpoint sealed from both ranks' parts, the restart of both with the new config from it, and a
checkpoint of two ranks resumed by one.

One supervised run is shared by the tests of this module (a module fixture): each test reads a
different part of what it left. The OOM is real: rank 1 alone gets a data-segment cap
(``RLIMIT_DATA``, the ``QLORA_SUPERVISE_TEST_RANK_CPU_CAP`` hook) after step 2, which micro-batch 8
at seq 256 overruns inside torch (about 960 MiB of data segment) and micro-batch 4 does not
(about 755 MiB).
"""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from _child import child_env, events, log_tail, make_spec, run_child, write_spec
from _machine import above_baseline, scaled

from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.commands.status import describe
from qlora_supervise.supervisor.loop import child as child_mod
from qlora_supervise.supervisor.record.eventlog import read_events
from qlora_supervise.supervisor.record.journal import AttemptRecord, read_attempts
from qlora_supervise.trainer_child.contract.codes import ExitCode
from qlora_supervise.trainer_child.contract.processes import pid_alive
from qlora_supervise.trainer_child.contract.report import ErrorReport

pytestmark = pytest.mark.slow
MIB = 1024 * 1024
#: Rank 1's cap above the import baseline of the torch installed here (``_machine``): 860 MiB with
#: the CPU build (0.37 GiB of imports), between the two micro-batches' data segments above.
RANK_CAP_HEADROOM = 480 * MIB
MAX_STEPS = 4
EFFECTIVE = 16
#: trainer.TEST_TRACE_BATCHES (not imported: that module imports torch into the test process).
TRACE = "QLORA_SUPERVISE_TEST_TRACE_BATCHES"


@dataclasses.dataclass(frozen=True)
class SupervisedRun:
    code: int
    run: Path
    trace: Path
    records: list[AttemptRecord]


def _job(tiny_dir: Path, root: Path) -> Path:
    job = yaml.safe_load((tiny_dir / "job.yaml").read_text())
    job["model"]["path"] = str(tiny_dir / "model")
    job["data"]["path"] = str(tiny_dir / "data.jsonl")
    job["train"].update(
        micro_batch_size=8,
        effective_batch_size=EFFECTIVE,
        gradient_checkpointing=False,
        max_seq_len=256,
        max_steps=MAX_STEPS,
        save_steps=3,  # no regular checkpoint of step 2: the ranks' emergency parts must serve
        logging_steps=1,
        warmup_ratio=0.0,
    )
    job["resources"] = {"gpu": "cpu", "nproc_per_node": 2}
    # The micro-batch rung, so that the restart shows accumulation rising with both ranks kept.
    ladder = ["halve_micro_batch"]
    job["supervise"] = {
        "hang_timeout": "5m",
        "backoff_initial": "0.1s",
        "backoff_max": "1s",
        "ladders": {"oom_forward": ladder, "oom_backward": ladder},
    }
    job["output_dir"] = str(root / "run")
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.fixture(scope="module")
def supervised(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisedRun]:
    """The supervised two-rank run, once for the module."""
    root = tmp_path_factory.mktemp("torchrun")
    trace = root / "batches.jsonl"
    job = _job(tiny_dir, root)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QLORA_SUPERVISE_TEST_RANK_CPU_CAP", f"1:{above_baseline(RANK_CAP_HEADROOM)}")
        patch.setenv("QLORA_SUPERVISE_TEST_CAP_AFTER_STEP", "2")
        patch.setenv(TRACE, str(trace))
        code = run_job(str(job), plain=True, console=io.StringIO(), install_signals=False)
    records, bad = read_attempts(root / "run" / "attempts.jsonl")
    assert bad == 0
    yield SupervisedRun(code, root / "run", trace, records)


def _batches(*paths: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in paths if path.exists() for line in path.read_text().splitlines()]


def _rows_by_step(batches: list[dict[str, Any]], micro: int) -> dict[int, list[str]]:
    """Each optimizer step's sample fingerprints, over all ranks, of the attempt run at ``micro``."""
    steps: dict[int, list[str]] = {}
    for batch in batches:
        if len(batch["rows"]) == micro:
            steps.setdefault(batch["step"], []).extend(batch["rows"])
    return steps


def test_one_ranks_oom_is_classified_with_its_rank_and_both_ranks_restart(supervised: SupervisedRun) -> None:
    """Rank 1's real OOM is the classified cause (its stage, rank 1), and both ranks restart halved."""
    assert supervised.code == 0, log_tail_of(supervised.run, 1)
    assert len(supervised.records) == 2
    first = supervised.records[0]
    assert first.outcome == "failed" and first.failure is not None
    assert first.failure.kind in ("oom_forward", "oom_backward")
    assert first.failure.stage in ("forward", "backward")
    assert (first.failure.rank, first.failure.local_rank) == (1, 1)
    assert "rank 1 (local rank 1) of 2 failed first" in first.failure.evidence
    assert first.failure.numbers["tried_to_allocate"] > 0
    attempt = supervised.run / "attempt-001"
    cause = ErrorReport.from_json((attempt / "error.rank1.json").read_text())
    assert cause.is_oom and cause.rank == 1 and cause.world_size == 2 and cause.exit_code == ExitCode.OOM
    if (attempt / "error.json").exists():  # rank 0 failed too: its broken collective, not an OOM
        assert not ErrorReport.from_json((attempt / "error.json").read_text()).is_oom
    classified = next(
        e for e in read_events(supervised.run / "events.jsonl") if e["event"] == "failure_classified"
    )
    assert classified["rank"] == 1 and classified["local_rank"] == 1
    assert first.decision is not None and first.decision.rung == "halve_micro_batch"
    assert first.decision.changes == {"micro_batch_size": (8, 4), "grad_accum": (1, 2)}
    for rank_file in ("child-events.jsonl", "child-events.rank1.jsonl"):  # both ranks, one config
        seen = [
            json.loads(line) for line in (supervised.run / "attempt-002" / rank_file).read_text().splitlines()
        ]
        resumed = next(e for e in seen if e["event"] == "resumed")
        assert (resumed["from_step"], resumed["micro_batch_size"], resumed["grad_accum"]) == (2, 4, 2)


def test_the_run_finishes_with_the_effective_batch_kept(supervised: SupervisedRun) -> None:
    """Both attempts ran 2 ranks with micro x accumulation x ranks = 16; the resumed one lost no step,
    resuming from the emergency checkpoint the two ranks' parts made."""
    assert supervised.code == 0
    assert all(r.knobs.world_size == 2 and r.knobs.effective_batch == EFFECTIVE for r in supervised.records)
    first, second = supervised.records
    assert first.steps_completed == 2 and first.next_resume_from == 2 and first.lost_steps == 0
    # Step 2 was saved by no regular checkpoint: both ranks wrote their parts of it, sealed as one.
    assert first.failure is not None and first.failure.emergency_checkpoint is not None
    sealed = json.loads(
        (supervised.run / "checkpoints" / "checkpoint-2" / "qlora_supervise_complete.json").read_text()
    )
    assert sealed["emergency"] and {"rng_state_0.pth", "rng_state_1.pth"} <= set(sealed["files"])
    assert any(e["event"] == "rank_parts_sealed" for e in read_events(supervised.run / "events.jsonl"))
    assert second.outcome == "succeeded" and second.resumed_from == 2 and second.steps_completed == MAX_STEPS
    assert (supervised.run / "adapter" / "adapter_model.safetensors").is_file()
    marker = json.loads(
        (
            supervised.run / "checkpoints" / f"checkpoint-{MAX_STEPS}" / "qlora_supervise_complete.json"
        ).read_text()
    )
    assert marker["knobs"]["world_size"] == 2 and "rng_state_1.pth" in marker["files"]
    assert "micro_batch 8 x accum 1 x ranks 2" in describe(first)[1]  # what status prints
    started = [e for e in read_events(supervised.run / "events.jsonl") if e["event"] == "attempt_started"]
    assert [e["effective_batch"] for e in started] == [EFFECTIVE, EFFECTIVE]
    # Every step trained 16 distinct samples, none twice; the resumed step 3 is the one the failed
    # attempt had begun (its ranks trace their micro-batches before the forward that failed).
    batches = _batches(supervised.trace, supervised.trace.with_name("batches.rank1.jsonl"))
    before, after = _rows_by_step(batches, 8), _rows_by_step(batches, 4)
    assert sorted(before) == [1, 2, 3] and sorted(after) == [3, 4]
    assert sorted(after[3]) == sorted(before[3])
    trained = [*before[1], *before[2], *after[3], *after[4]]
    assert len(trained) == len(set(trained)) == MAX_STEPS * EFFECTIVE


def test_a_checkpoint_of_two_ranks_resumes_with_one(
    supervised: SupervisedRun, tmp_path: Path, tiny_dir: Path
) -> None:
    """Checkpoint 2 of the two-rank run resumes in one process (accumulation x2) at step 2, same samples."""
    assert supervised.code == 0
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    source = shutil.copytree(supervised.run / "checkpoints" / "checkpoint-2", checkpoints / "checkpoint-2")
    trace = tmp_path / "one-rank.jsonl"
    spec = make_spec(
        tiny_dir,
        tmp_path,
        knobs={"micro_batch_size": 4, "grad_accum": 4, "max_seq_len": 256, "world_size": 1},
        train={"max_steps": MAX_STEPS, "save_steps": 100, "warmup_ratio": 0.0},
        resume_from=str(source),
    )
    assert spec.knobs.effective_batch == EFFECTIVE
    # One thread, as torchrun gives each rank: on 2 busy cores the default two threads run 3x slower.
    assert run_child(spec, OMP_NUM_THREADS="1", **{TRACE: str(trace)}) == ExitCode.OK, log_tail(spec)
    seen = events(spec)
    resumed = next(e for e in seen if e["event"] == "resumed")
    assert resumed["from_step"] == 2 and resumed["reset_optimizer"] is False
    assert next(e for e in seen if e["event"] == "finished")["step"] == MAX_STEPS
    one = _rows_by_step(_batches(trace), 4)
    two = _rows_by_step(_batches(supervised.trace, supervised.trace.with_name("batches.rank1.jsonl")), 4)
    assert sorted(one) == [3, 4]
    for step in (3, 4):  # the same samples as the two ranks trained at those steps, none skipped
        assert sorted(one[step]) == sorted(two[step]), step


def test_sigterm_reaches_the_ranks_through_torchrun_and_they_checkpoint_together(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """The supervisor's stop (SIGTERM to torchrun) stops both ranks after one step, which rank 0 saves."""
    spec = make_spec(
        tiny_dir,
        tmp_path,
        knobs={"micro_batch_size": 1, "grad_accum": 1, "max_seq_len": 64, "world_size": 2},
        train={"max_steps": 500, "save_steps": 1000},
    )
    path = write_spec(spec)
    argv = child_mod.child_argv(path, "train")
    assert argv[1:3] == ["-m", "torch.distributed.run"] and str(path) in argv
    proc = child_mod.spawn_child(argv, child_env(), path.parent / "child.log", tmp_path)
    try:
        _wait(lambda: _step(spec) >= 2 and len(child_mod.trainer_pids(proc.pid)) == 2, proc)
        ranks = child_mod.trainer_pids(proc.pid)
        proc.stop(120)
    finally:
        if proc.poll() is None:
            proc.popen.kill()
    assert not [pid for pid in ranks if pid_alive(pid)]
    stops = {}
    for rank, name in ((0, "child-events.jsonl"), (1, "child-events.rank1.jsonl")):
        seen = [json.loads(line) for line in (path.parent / name).read_text().splitlines()]
        # The stop reached this rank (the launcher's log says when each rank got it, if not).
        launcher_log = (path.parent / "child.log").read_text()[-3000:]
        assert any(e["event"] == "stopping" for e in seen), (rank, launcher_log)
        # A rank beats after every completed step; its last step is the one it stopped after.
        # (``stopping`` carries the step at which this rank saw the signal, which torchrun
        # delivers to the ranks at slightly different moments: not the agreed step.)
        stops[rank] = max(e["step"] for e in seen if e["event"] == "heartbeat")
    assert stops[0] == stops[1] > 0, stops  # the ranks agreed on the step to stop after
    saved = [e["step"] for e in events(spec) if e["event"] == "checkpoint_saved"]
    assert saved == [stops[0]]
    assert (Path(spec.checkpoints_dir) / f"checkpoint-{stops[0]}" / "rng_state_1.pth").is_file()
    assert not list(path.parent.glob("error*.json"))  # a stop is no failure on any rank


def _step(spec: Any) -> int:
    return max((e.get("step") or 0 for e in events(spec) if e["event"] == "heartbeat"), default=0)


def _wait(predicate: Any, proc: Any, timeout: float | None = None) -> None:
    timeout = timeout if timeout is not None else scaled(240)  # generous, scaled to this machine
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, "torchrun exited early"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.3)


def log_tail_of(run: Path, attempt: int) -> str:
    path = run / f"attempt-{attempt:03d}" / "child.log"
    return path.read_text()[-4000:] if path.exists() else "(no log)"
