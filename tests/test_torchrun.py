"""Several ranks without torch: the launch command, the first failure among the ranks' reports,
per-rank peaks, drop_rank and the effective batch, the job field, and the signal to the ranks."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from qlora_supervise.policies import decide as policy
from qlora_supervise.policies.rungs import RUNG_BY_NAME, RungContext, rung_by_name
from qlora_supervise.supervisor.diagnosis.classify import first_failure, is_knock_on
from qlora_supervise.supervisor.facts.failure import ChildExit, Failure, XidFacts
from qlora_supervise.supervisor.jobfile import JobError, load_job
from qlora_supervise.supervisor.jobfile import world as world_mod
from qlora_supervise.supervisor.loop import child as child_mod
from qlora_supervise.supervisor.loop.child_output import note_rank_exits
from qlora_supervise.supervisor.loop.outcome import AttemptOutcome, failure_record, judge
from qlora_supervise.supervisor.loop.planner import Plan
from qlora_supervise.supervisor.loop.resume import resume_point
from qlora_supervise.supervisor.record.generations import FieldChange
from qlora_supervise.supervisor.record.journal import AttemptRecord, Outcome, Phase
from qlora_supervise.supervisor.watching.watch import Progress, Watched, read_rank_peaks, uneven
from qlora_supervise.trainer_child.contract.checkpoints import publish
from qlora_supervise.trainer_child.contract.codes import ExitCode, FailureKind, Stage
from qlora_supervise.trainer_child.contract.events import Heartbeat, MemoryNumbers
from qlora_supervise.trainer_child.contract.report import ErrorReport
from qlora_supervise.trainer_child.contract.spec import (
    AttemptSpec,
    DataSpec,
    Knobs,
    TrainSpec,
    rank_file,
    rank_files,
)
from qlora_supervise.trainer_child.run.torchrun import (
    TEST_RANK_CPU_CAP,
    TEST_RANK_GPU_CAP,
    RankPlace,
    rank_spec,
    this_rank,
)

MIB = 1024 * 1024
TWO = Knobs(model="m", micro_batch_size=4, grad_accum=2, world_size=2)
GLOO_TIMEOUT = (
    "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:53651. This is typically caused by a remote worker crashing."
)


def _report(
    rank: int, when: float, *, oom: bool = False, message: str = "", code: int = ExitCode.FAILED
) -> ErrorReport:
    return ErrorReport(
        exit_code=ExitCode.OOM if oom else code,
        exception_type="OutOfMemoryError" if oom else "RuntimeError",
        message=message
        or ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1024 bytes" if oom else ""),
        traceback="",
        stage=Stage.FORWARD if oom else Stage.BACKWARD,
        step=2,
        is_oom=oom,
        time=when,
        rank=rank,
        local_rank=rank,
        world_size=2,
    )


# ---- the launch --------------------------------------------------------------------------


def test_one_process_starts_the_child_and_several_start_torchrun_with_no_restarts_of_its_own(
    tmp_path: Path,
) -> None:
    """World size 1 runs the child itself; 2 runs torchrun --standalone --max-restarts 0, the stop grace."""
    spec = tmp_path / "attempt-001" / "spec.json"
    assert child_mod.command(spec, "train") == [
        sys.executable,
        "-m",
        "qlora_supervise.trainer_child",
        "--spec",
        str(spec),
    ]
    argv = child_mod.command(spec, "train", 2, 90.0)
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    joined = " ".join(argv)
    assert "--standalone --nproc-per-node 2 --max-restarts 0 --shutdown-timeout 90" in joined
    assert argv[-4:] == ["-m", "qlora_supervise.trainer_child", "--spec", str(spec)]
    assert (
        child_mod.command(spec, "merge", 2)[2] == "qlora_supervise.trainer_child.merge.process"
    )  # merging is one process


def test_the_argv_follows_the_written_spec(tmp_path: Path) -> None:
    """child_argv reads the spec the runner wrote: its world size and stop grace decide the command."""
    spec = _spec(tmp_path, dataclasses.replace(TWO), stop_grace_s=42.0)
    path = tmp_path / "spec.json"
    path.write_text(spec.to_json())
    argv = child_mod.child_argv(path, "train")
    assert (
        argv[argv.index("--nproc-per-node") + 1] == "2" and argv[argv.index("--shutdown-timeout") + 1] == "42"
    )
    assert argv[-2:] == ["--spec", str(path)]  # reclaim finds the orphans by it
    assert child_mod.child_argv(tmp_path / "missing.json", "train")[1:3] == [
        "-m",
        "qlora_supervise.trainer_child",
    ]


def _spec(tmp_path: Path, knobs: Knobs, **fields: object) -> AttemptSpec:
    return AttemptSpec(
        attempt=1,
        run_dir=str(tmp_path),
        knobs=knobs,
        data=DataSpec(path="d.jsonl"),
        train=TrainSpec(),
        events_file=str(tmp_path / "child-events.jsonl"),
        error_file=str(tmp_path / "error.json"),
        checkpoints_dir=str(tmp_path / "checkpoints"),
        adapter_dir=str(tmp_path / "adapter"),
        merged_dir=str(tmp_path / "merged"),
        **fields,  # type: ignore[arg-type]
    )


# ---- each rank's files -------------------------------------------------------------------


def test_each_rank_writes_its_own_files_and_the_fault_hook_caps_one_rank(tmp_path: Path) -> None:
    """Rank 0 keeps the spec's paths, rank 1 writes error.rank1.json; the hook caps only the rank it names."""
    assert rank_file("/r/a/error.json", 0) == "/r/a/error.json"
    assert rank_file("/r/a/child-events.jsonl", 3) == "/r/a/child-events.rank3.jsonl"
    spec = _spec(tmp_path, TWO)
    place = this_rank({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"})
    assert place == RankPlace(1, 1, 2) and not place.is_main and this_rank({}) == RankPlace()
    one = rank_spec(spec, place, {TEST_RANK_CPU_CAP: f"1:{900 * MIB}"})
    zero = rank_spec(spec, RankPlace(0, 0, 2), {TEST_RANK_CPU_CAP: f"1:{900 * MIB}"})
    assert one.error_file.endswith("error.rank1.json") and one.cpu_memory_limit == 900 * MIB
    assert zero.error_file == spec.error_file and zero.cpu_memory_limit is None
    gpu = rank_spec(spec, place, {TEST_RANK_GPU_CAP: f"1:{8 * 1024 * MIB}"})
    assert gpu.gpu_memory_limit == 8 * 1024 * MIB and gpu.cpu_memory_limit is None
    for name in ("error.json", "error.rank1.json", "error.rank10.json", "error.rankx.json"):
        (tmp_path / name).write_text("{}")
    assert [rank for rank, _ in rank_files(str(tmp_path / "error.json"))] == [0, 1, 10]


# ---- the first failure -------------------------------------------------------------------


def test_the_earliest_real_failure_is_the_cause_and_broken_collectives_are_knock_on() -> None:
    """Rank 1's OOM is the cause though rank 0's gloo error came first; of two real ones, the earliest."""
    oom = _report(1, 10.0, oom=True)
    broken = _report(0, 9.0, message=GLOO_TIMEOUT)
    assert is_knock_on(broken) and not is_knock_on(oom)
    assert is_knock_on(_report(0, 1.0, message="Watchdog caught collective operation timeout: WorkNCCL(...)"))
    assert is_knock_on(_report(0, 1.0, code=ExitCode.STOPPED))
    cause = first_failure([broken, oom])
    assert cause is not None and cause.report is oom and cause.knock_on == (0,)
    assert cause.why.startswith("rank 1 (local rank 1) of 2 failed first")
    both = first_failure([_report(0, 5.0, oom=True), _report(1, 4.0, oom=True)])
    assert both is not None and both.report.rank == 1
    only_broken = first_failure([broken, _report(1, 9.5, message=GLOO_TIMEOUT)])
    assert only_broken is not None and only_broken.report is broken and "left no report" in only_broken.why
    assert first_failure([]) is None


def test_judge_names_the_rank_and_gpu_of_the_cause_in_the_failure_and_its_record() -> None:
    """A two-rank attempt's failure carries rank 1 / local rank 1 and its card (GPU 3) into the journal."""
    oom, broken = _report(1, 10.0, oom=True), _report(0, 9.0, message=GLOO_TIMEOUT)
    outcome = AttemptOutcome(
        number=1,
        plan=Plan(Phase.TRAIN, TWO),
        exit=ChildExit(1, None, None, 3.0),  # torchrun's own exit status after a rank failed
        progress=Progress(step=2),
        report=first_failure([broken, oom]).report,  # type: ignore[union-attr]
        memory=Watched(Progress(), cards={0: 2, 1: 3}),  # NVML watched local ranks 0, 1 on GPUs 2, 3
        resumed_from=0,
        started_at=0.0,
        ended_at=1.0,
        log_tail="",
        reports=(broken, oom),
    )
    failure = judge(outcome, phase_done=False)
    assert isinstance(failure, Failure)
    assert (failure.kind, failure.stage, failure.rank, failure.local_rank) == (
        FailureKind.OOM_FORWARD,
        Stage.FORWARD,
        1,
        1,
    )
    assert "rank 1 (local rank 1) of 2 failed first; rank(s) 0 followed" in failure.evidence
    assert failure.gpu == 3 and "trains on GPU 3" in failure.evidence
    record = failure_record(failure, outcome.report)
    assert Failure.from_json(record.to_json()) == record and record.rank == 1


def test_records_and_knobs_written_before_ranks_still_read() -> None:
    """A journal line without world_size or rank reads as one process."""
    knobs = Knobs(
        **{k: v for k, v in dataclasses.asdict(Knobs(model="m")).items() if k not in ("world_size", "gpus")}
    )
    assert knobs.world_size == 1 and knobs.effective_batch == 16
    failure = Failure.from_json({"kind": "oom_forward", "stage": "forward", "evidence": "e"})
    assert failure.rank is None and failure.local_rank is None
    line = AttemptRecord(
        1, Phase.TRAIN, TWO, Outcome.FAILED, 0.0, 1.0, 1, None, 0, 0, 0, 0, failure=failure
    ).to_line()
    assert AttemptRecord.from_json(json.loads(line)).knobs == TWO


# ---- per-rank peaks ----------------------------------------------------------------------


def test_one_rank_well_above_the_others_is_uneven(tmp_path: Path) -> None:
    """Each rank's heartbeats give its peak; 30 % and 300 MiB above the other is uneven, a few MiB is not."""
    for rank, peak in ((0, 1000 * MIB), (1, 1300 * MIB)):
        beat = Heartbeat(Stage.FORWARD, 3, memory=MemoryNumbers(peak_bytes=peak))
        Path(rank_file(str(tmp_path / "child-events.jsonl"), rank)).write_text(beat.to_line())
    peaks = read_rank_peaks(tmp_path / "child-events.jsonl")
    assert peaks == {0: 1000 * MIB, 1: 1300 * MIB}
    found = uneven(peaks)
    assert (
        found is not None
        and (found.high_rank, found.low_rank) == (1, 0)
        and round(found.share_above, 2) == 0.3
    )
    assert uneven({0: 1000 * MIB, 1: 1010 * MIB}) is None
    assert uneven({0: 100 * MIB, 1: 150 * MIB}) is None  # 50 % but only 50 MiB: noise on a tiny model
    assert uneven({0: 1000 * MIB}) is None


# ---- the ladder and the effective batch --------------------------------------------------


def test_halving_the_micro_batch_keeps_micro_accum_and_ranks() -> None:
    """Micro 4 x 2 on 2 ranks becomes micro 2 x 4 on 2 ranks: still 16."""
    halved = RUNG_BY_NAME["halve_micro_batch"].apply(TWO)
    assert halved is not None and (halved.micro_batch_size, halved.grad_accum, halved.world_size) == (2, 4, 2)
    assert halved.effective_batch == TWO.effective_batch == 16


def test_drop_rank_leaves_the_failing_card_out_and_keeps_the_batch_exactly() -> None:
    """2 -> 1 ranks doubles accumulation; the failing local rank's card is left out; inexact is refused."""
    dropped = rung_by_name("drop_rank", RungContext()).apply(TWO)
    assert dropped is not None and (dropped.world_size, dropped.grad_accum, dropped.gpus) == (1, 4, "")
    assert dropped.effective_batch == TWO.effective_batch
    first_out = rung_by_name("drop_rank", RungContext(failed_local_rank=0)).apply(TWO)
    assert first_out is not None and first_out.gpus == "1"
    three = dataclasses.replace(TWO, world_size=3, grad_accum=2)
    assert (after := rung_by_name("drop_rank", RungContext(failed_local_rank=1)).apply(three)) is not None
    assert (after.world_size, after.grad_accum, after.gpus) == (2, 3, "0,2") and after.effective_batch == 24
    assert (
        rung_by_name("drop_rank", RungContext()).apply(dataclasses.replace(three, grad_accum=1)) is None
    )  # 3 x 1 over 2 ranks
    assert rung_by_name("drop_rank", RungContext()).apply(Knobs(model="m")) is None
    assert rung_by_name("drop_rank", RungContext()).name == "drop_rank"
    assert child_mod.rank_cards("3,5,7", [0, 2]) == "3,7" and child_mod.rank_cards(None, [1]) == "1"
    env = child_mod.child_env({"CUDA_VISIBLE_DEVICES": "4,6", "RANK": "3", "WORLD_SIZE": "8"}, first_out)
    assert env["CUDA_VISIBLE_DEVICES"] == "6"
    assert "RANK" not in env and "WORLD_SIZE" not in env  # torchrun gives the ranks their place


def test_a_card_that_keeps_failing_drops_its_rank_instead_of_giving_up() -> None:
    """A fatal Xid on one of 2 ranks restarts on the other card; on one process it still gives up."""
    xid = Failure(FailureKind.GPU_FAULT, Stage.FORWARD, {}, "nvml", local_rank=1, xid=XidFacts((79,), 79))
    this = policy.PastAttempt(TWO, FailureKind.GPU_FAULT, 0)
    restart = policy.decide(xid, TWO, [this], policy.Settings())
    assert isinstance(restart, policy.Restart) and restart.rung == "drop_rank"
    assert restart.knobs.world_size == 1 and restart.knobs.effective_batch == TWO.effective_batch
    assert restart.changes == {"grad_accum": (2, 4), "world_size": (2, 1)}
    alone = dataclasses.replace(TWO, world_size=1)
    assert isinstance(policy.decide(xid, alone, [this], policy.Settings()), policy.GiveUp)
    contention = Failure(
        FailureKind.OOM_CONTENTION, Stage.FORWARD, {"tried_to_allocate": 10 * MIB}, "c", local_rank=0
    )
    timed_out = policy.WaitResult(free_bytes=0, waited_s=1800.0)
    after = policy.decide(contention, TWO, [this], policy.Settings(), waited=timed_out)
    assert isinstance(after, policy.Restart) and after.rung == "drop_rank" and after.knobs.gpus == "1"


def test_a_rank_killed_with_no_report_is_named_and_its_card_dropped_when_it_keeps_dying() -> None:
    """Rank 1 SIGKILLed leaves no report and rank 0 only a broken collective (or none: then torchrun's
    summary names it): rank 1 is the cause, and when that comes back with no step trained in
    between, drop_rank leaves card 1 out."""
    broken = _report(0, 9.0, message=GLOO_TIMEOUT)
    outcome = AttemptOutcome(
        number=1, plan=Plan(Phase.TRAIN, TWO), exit=ChildExit(1, None, None, 3.0), progress=Progress(step=2),
        report=broken, memory=Watched(Progress(), cards={0: 2, 1: 3}), resumed_from=0, started_at=0.0,
        ended_at=1.0, log_tail="", reports=(broken,),
    )  # fmt: skip
    failure = judge(outcome, phase_done=False)
    assert isinstance(failure, Failure) and (failure.rank, failure.local_rank, failure.gpu) == (1, 1, 3)
    assert "rank 1 left no report" in failure.evidence
    settings = policy.Settings()
    history = [policy.PastAttempt(TWO, failure.kind, 0) for _ in range(settings.max_no_progress)]
    restart = policy.decide(failure, TWO, history, settings)
    assert isinstance(restart, policy.Restart) and restart.rung == "drop_rank", restart
    assert restart.knobs.gpus == "0" or restart.knobs.gpus == ""  # card 1 left out: card 0 is rank 0
    assert restart.knobs.world_size == 1 and restart.knobs.effective_batch == TWO.effective_batch
    # No rank reported at all (rank 0 was stopped in its load): torchrun's own summary names rank 1.
    summary = (
        "Root Cause (first observed failure):\n[0]:\n  time      : 2026-12-04_15:12:43\n  host      : h\n"
        "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 6482)\n  traceback : Signal 9 (SIGKILL)\n"
    )
    silent = dataclasses.replace(outcome, report=None, reports=(), log_tail=summary)
    unreported = judge(silent, phase_done=False)
    assert isinstance(unreported, Failure) and (unreported.local_rank, unreported.gpu) == (1, 3)
    assert "rank 1 failed and no rank reported: torchrun saw it fail first" in unreported.evidence
    # The supervisor saw rank 0's process leave first: that outweighs torchrun's summary.
    first_gone = dataclasses.replace(silent.memory, rank_exits={1: 12.0, 0: 5.0})  # when each was seen gone
    seen = judge(dataclasses.replace(silent, memory=first_gone), phase_done=False)
    assert isinstance(seen, Failure) and seen.local_rank == 0 and "its process left first" in seen.evidence


def test_the_supervisor_notes_when_each_ranks_process_is_gone(tmp_path: Path) -> None:
    """Each rank's pid comes from its started event; a process that exited is noted, a live one not."""
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    spec = AttemptSpec(
        attempt=1, run_dir=str(tmp_path), knobs=TWO, data=DataSpec(path="d"), train=TrainSpec(),
        events_file=str(tmp_path / "child-events.jsonl"), error_file=str(tmp_path / "error.json"),
        checkpoints_dir="c", adapter_dir="a", merged_dir="m",
    )  # fmt: skip
    for rank, pid in ((0, os.getpid()), (1, int(gone.stdout))):
        Path(rank_file(spec.events_file, rank)).write_text(
            json.dumps({"event": "started", "pid": pid, "rank": rank}) + "\n"
        )
    watched = Watched(Progress())
    note_rank_exits(spec, watched, 7.0)
    assert watched.rank_pids == {0: os.getpid(), 1: int(gone.stdout)} and watched.rank_exits == {1: 7.0}


# ---- the job field -----------------------------------------------------------------------


def _job(
    tmp_path: Path, resources: str, train: str = "{micro_batch_size: 2, effective_batch_size: 8}"
) -> Path:
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "data.jsonl").write_text('{"text": "a"}\n')
    path = tmp_path / "job.yaml"
    path.write_text(
        textwrap.dedent(f"""\
        model: {{path: ./model}}
        data: {{path: ./data.jsonl}}
        train: {train}
        resources: {resources}
        """)
    )
    return path


def _problems(path: Path) -> dict[str, str]:
    with pytest.raises(JobError) as caught:
        load_job(path)
    return {p.path: p.render() for p in caught.value.problems}


def test_nproc_per_node_sets_the_world_size_and_divides_the_batch(tmp_path: Path) -> None:
    """nproc_per_node 2 with micro 2 and effective 8: accumulation 2 per rank, world_size 2 in the knobs."""
    job = load_job(_job(tmp_path, "{gpu: cpu, nproc_per_node: 2}"))
    assert (job.knobs.world_size, job.knobs.micro_batch_size, job.knobs.grad_accum) == (2, 2, 2)
    assert job.knobs.effective_batch == 8
    assert load_job(_job(tmp_path, "{gpu: cpu}")).knobs.world_size == 1


def test_bad_nproc_per_node_is_refused_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """0 ranks, one named GPU for 2 ranks, more ranks than GPUs, a batch that cannot split: each named."""
    assert "resources.nproc_per_node" in _problems(_job(tmp_path, "{nproc_per_node: 0}"))
    named = _problems(_job(tmp_path, "{gpu: 0, nproc_per_node: 2}"))
    assert "gpu: auto" in named["resources.gpu"]
    monkeypatch.setattr(world_mod, "visible_gpu_count", lambda: 2)
    many = _problems(_job(tmp_path, "{gpu: auto, nproc_per_node: 4}"))["resources.nproc_per_node"]
    assert "2 GPU(s) are visible" in many and "lower nproc_per_node to 2" in many
    odd = _problems(_job(tmp_path, "{gpu: cpu, nproc_per_node: 3}"))
    assert "micro_batch_size x nproc_per_node (6)" in odd["train.effective_batch_size"]


def test_parallel_fsdp_is_a_knob_of_two_or_more_gpu_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """parallel: fsdp sets Knobs.fsdp; one rank has nothing to shard with, CPU ranks would be DDP."""
    monkeypatch.setattr(world_mod, "visible_gpu_count", lambda: 2)
    job = load_job(_job(tmp_path, "{gpu: auto, nproc_per_node: 2, parallel: fsdp}"))
    assert job.knobs.fsdp and job.knobs.world_size == 2
    assert not load_job(_job(tmp_path, "{gpu: auto, nproc_per_node: 2}")).knobs.fsdp
    assert "nproc_per_node: 2 or more" in _problems(_job(tmp_path, "{parallel: fsdp}"))["resources.parallel"]
    cpu = _problems(_job(tmp_path, "{gpu: cpu, nproc_per_node: 2, parallel: fsdp}"))["resources.parallel"]
    assert "FSDP needs GPUs" in cpu


def test_changing_nproc_per_node_of_a_run_needs_restart() -> None:
    """The ranks are in the journal's knobs: a changed nproc_per_node is not applied silently on resume."""
    assert not FieldChange("resources.nproc_per_node", 2, None).safe
    assert not FieldChange("resources.parallel", "fsdp", None).safe  # a checkpoint's layout is the mode's


def test_drop_rank_to_one_leaves_fsdp_and_its_optimizer_state_is_reset_on_resume(tmp_path: Path) -> None:
    """FSDP on 2 ranks dropped to 1 trains as one process, from the adapter of FSDP's checkpoint with a
    fresh optimizer (FSDP's optimizer.bin is laid out its own way)."""
    fsdp = dataclasses.replace(TWO, fsdp=True)
    context = RungContext(failed_local_rank=1)
    one = rung_by_name("drop_rank", context).step(fsdp, context)
    assert one is not None and (one.world_size, one.fsdp, one.effective_batch) == (
        1,
        False,
        TWO.effective_batch,
    )
    three = rung_by_name("drop_rank", context).step(
        dataclasses.replace(fsdp, world_size=3, grad_accum=2), context
    )
    assert three is not None and three.fsdp  # two ranks left still shard
    written = tmp_path / "checkpoints" / ".tmp-checkpoint-4"
    written.mkdir(parents=True)
    (written / "adapter_model.safetensors").write_bytes(b"a")
    (written / "optimizer.bin").write_bytes(b"fsdp's")
    publish(written, tmp_path / "checkpoints" / "checkpoint-4", step=4, knobs=fsdp, emergency=False)
    assert resume_point(tmp_path / "checkpoints", one).reset_optimizer
    assert not resume_point(tmp_path / "checkpoints", fsdp).reset_optimizer
    assert FieldChange("resources.cpu_memory_limit", 1, 2).safe


# ---- the early-checkpoint signal ---------------------------------------------------------

_RANK = """
import signal, sys, time
from pathlib import Path
got = Path(sys.argv[1])
signal.signal(signal.SIGUSR1, lambda *_: got.write_text("usr1"))
Path(str(got) + ".ready").write_text("")
deadline = time.monotonic() + 20
while not got.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
"""
_LAUNCHER = """
import subprocess, sys, time
ranks = [subprocess.Popen([sys.executable, "-c", sys.argv[1], out, "qlora_supervise.trainer_child"])
         for out in sys.argv[2:4]]
for rank in ranks:
    rank.wait()
"""


def test_the_early_checkpoint_signal_reaches_the_ranks_and_spares_the_launcher(tmp_path: Path) -> None:
    """SIGUSR1 for a torchrun child goes to its ranks; the launcher, which it would kill, gets none."""
    outs = [str(tmp_path / "rank0"), str(tmp_path / "rank1")]
    # argv[-1] names torchrun's module, as the real launcher's command line does.
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _RANK, *outs, "torch.distributed.run"])
    try:
        deadline = time.monotonic() + 20
        while not all(Path(out + ".ready").exists() for out in outs):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert len(child_mod.trainer_pids(launcher.pid)) == 2
        child_mod._signal_child(launcher.pid, signal.SIGUSR1)
        assert launcher.wait(20) == 0  # not killed by SIGUSR1: it waited for its ranks
    finally:
        if launcher.poll() is None:
            os.kill(launcher.pid, signal.SIGKILL)
    assert all(Path(out).read_text() == "usr1" for out in outs)
    assert child_mod.trainer_pids(os.getpid()) == [os.getpid()]  # a single process is its own trainer
