"""Host memory in the plan (issue 28): the host model, the host budget every candidate must fit,
``plan --host-memory`` on the 8 GB-card user's Llama-3-8B job, the stop before any child when
nothing fits the host, and a host OOM kill under offload charged to offload."""

from __future__ import annotations

import dataclasses
import io
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_plan import LLAMA3_8B, write_safetensors

from qlora_supervise.policies.decide import PastAttempt, Restart, Settings, decide
from qlora_supervise.policies.ladder import climb
from qlora_supervise.policies.memory.host import (
    IMPORTS_RSS,
    TRAIN_RESIDENT_RSS,
    host_train_need,
    offloaded_bytes,
    pinned,
)
from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.policies.search import config_search as preflight
from qlora_supervise.policies.search.budget import HostBudget, host_budget, host_for_budget, host_reserve
from qlora_supervise.policies.search.search_state import fit_limit
from qlora_supervise.supervisor.commands import cli
from qlora_supervise.supervisor.commands.plan import plan_command
from qlora_supervise.supervisor.facts.units import parse_bytes
from qlora_supervise.supervisor.jobfile.load import load_job
from qlora_supervise.supervisor.loop.settings import policy_settings, predicted_host
from qlora_supervise.supervisor.record.journal import AttemptRecord, HostMemory, Outcome, Phase
from qlora_supervise.trainer_child.contract.codes import FailureKind, Stage
from qlora_supervise.trainer_child.contract.spec import Knobs

GiB = 1 << 30
SHAPE = ModelShape.from_config({**LLAMA3_8B, "model_type": "llama"})
CHECKPOINT = 16_060_522_496
#: The seeds' user: Llama-3-8B, seq 2048, micro-batch 1, checkpointing, for an 8 GiB card.
USER = Knobs(model="/m/8b", micro_batch_size=1, grad_accum=16, max_seq_len=2048, gradient_checkpointing=True)
#: The job that took the host on the H200: seq 4096, micro-batch 4, no checkpointing.
GREEDY = Knobs(
    model="/m/8b",
    micro_batch_size=4,
    grad_accum=4,
    max_seq_len=4096,
    gradient_checkpointing=False,
    optimizer="adamw_torch",
)


def _user_job(tmp_path: Path, extra: str = "", shards: int = 0) -> Path:
    """The user's job on a config.json-only model directory (no download: the checkpoint's size is
    its parameters in 16 bits and its shards are unknown), or with ``shards`` header-only
    safetensors files of 4.2 GB each (sparse), as the released Llama-3-8B is cut (4 files of up to 5 GB)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA3_8B))
    (tmp_path / "data.jsonl").write_text('{"text": "hello"}\n')
    weight_map = {}
    for n in range(shards):
        name = f"model-{n + 1:05d}-of-{shards:05d}.safetensors"
        projections = ("q_proj", "k_proj", "v_proj", "o_proj")  # named as the targets are; sized to fill
        tensors = {f"model.layers.{n}.self_attn.{p}.weight": ("BF16", [128256, 4096]) for p in projections}
        write_safetensors(model / name, tensors)
        with (model / name).open("r+b") as handle:  # sparse: the file's size, as downloaded, no data
            handle.truncate(handle.seek(0, 2) + 4 * 128256 * 4096 * 2)
        weight_map.update(dict.fromkeys(tensors, name))
    if shards:
        index = {"metadata": {"total_size": shards * 4 * 128256 * 4096 * 2}, "weight_map": weight_map}
        (model / "model.safetensors.index.json").write_text(json.dumps(index))
    job = tmp_path / "job.yaml"
    job.write_text(
        "model: {path: model}\ndata: {path: data.jsonl}\n"
        "train: {max_seq_len: 2048, micro_batch_size: 1, effective_batch_size: 16,"
        " gradient_checkpointing: true}\n" + extra
    )
    return job


# ---- the host model ------------------------------------------------------------------------------


def test_offloaded_activations_with_checkpointing_are_the_block_inputs_in_pinned_blocks() -> None:
    """With checkpointing offload holds each block's fp32 input (rounded to a power of two when
    pinned) and two more for the final norm and the head; without it, every activation: far more."""
    knobs = dataclasses.replace(USER, activation_offload=True)
    block = 2048 * 4096 * 4
    assert offloaded_bytes(SHAPE, knobs) == (32 + 2) * pinned(block) == 34 * block  # 32 MiB: a power of 2
    odd = dataclasses.replace(knobs, max_seq_len=1500)
    assert (
        offloaded_bytes(SHAPE, odd) == 34 * pinned(1500 * 4096 * 4) > offloaded_bytes(SHAPE, odd, pin=False)
    )
    assert offloaded_bytes(SHAPE, USER) == 0
    greedy = dataclasses.replace(GREEDY, activation_offload=True)
    assert offloaded_bytes(SHAPE, greedy) > 10 * offloaded_bytes(
        SHAPE, dataclasses.replace(greedy, gradient_checkpointing=True)
    )
    assert pinned(1) == 1 and pinned(1025) == 2048 and pinned(0) == 0


def test_the_host_need_is_the_larger_of_the_loads_and_trainings() -> None:
    """The load needs the imports and its largest shard in the page cache (the whole checkpoint when
    the shards are unknown), while its RSS peak (the mapped checkpoint) is reported as measured; a
    small offload needs most at the load, the greedy offload in training."""
    small = host_train_need(SHAPE, dataclasses.replace(USER, activation_offload=True), CHECKPOINT)
    assert small.phase == "load" and small.peak_bytes == small.load_need > 15 * GiB
    sharded = host_train_need(SHAPE, USER, CHECKPOINT, largest_shard_bytes=5_000_000_000)
    assert sharded.load_need == 1_600_000_000 + 5_000_000_000 and sharded.peak_bytes < 7 * GiB
    assert sharded.load_peak == small.load_peak > 15 * GiB  # the RSS, mapped pages included
    assert small.train_components["resident"] == TRAIN_RESIDENT_RSS
    assert small.train_peak == sum(small.train_components.values())
    greedy = host_train_need(SHAPE, dataclasses.replace(GREEDY, activation_offload=True), CHECKPOINT)
    assert greedy.phase == "train" and greedy.peak_bytes > 60 * GiB
    paged = host_train_need(
        SHAPE, dataclasses.replace(USER, optimizer="paged_adamw_8bit", lora_r=256), CHECKPOINT
    )
    assert paged.train_components.get("paged_optimizer_state", 0) > 0


def test_the_host_budget_is_a_size_else_the_jobs_limit_else_what_is_available_less_a_reserve() -> None:
    """First match: --host-memory less the reserve (the plan's what-if, over the job's limit too);
    the job's host_memory_limit as it is; available now capped by the cgroup, less the reserve (1
    GiB, or 5 % of a larger host)."""
    assert host_budget(1, 100 * GiB, None, job_limit=7 * GiB).budget_bytes == 7 * GiB
    both = host_budget(1, 100 * GiB, None, job_limit=7 * GiB, host_size=24 * GiB)
    assert both.source == "flag" and both.budget_bytes == 24 * GiB - host_reserve(24 * GiB)
    flag = host_budget(1, 100 * GiB, None, host_size=24 * GiB)
    assert flag.source == "flag" and flag.budget_bytes == 24 * GiB - host_reserve(24 * GiB)
    assert host_reserve(8 * GiB) == GiB and host_reserve(128 * GiB) == int(128 * GiB * 0.05)
    capped = host_budget(1, 100 * GiB, 20 * GiB)
    assert capped.source == "available" and capped.budget_bytes == 19 * GiB


# ---- the pre-flight ---------------------------------------------------------------------------------


def test_a_candidate_over_the_host_budget_is_no_candidate_and_the_result_says_why() -> None:
    """The H200 case on a 10 GiB card with a 64 GiB host: offload without checkpointing (about 69 GiB
    of host RAM at micro-batch 2) is neither among the candidates nor in the speed trial, and the
    result counts what the host ruled out."""
    host = HostBudget(64 * GiB, CHECKPOINT, "job")
    result = preflight.preflight(SHAPE, GREEDY, 10 * GiB, host=host)
    assert result.fits and result.host_peak_bytes is not None
    limit = fit_limit(64 * GiB)
    assert all(r.host_peak_bytes is not None and r.host_peak_bytes <= limit for r in result.ranking)
    assert all(
        c.predicted_host_bytes is not None and c.predicted_host_bytes <= limit for c in result.speed_trial
    )
    rejected, smallest = result.host_rejected
    assert rejected > 0 and smallest is not None and smallest > limit
    assert any("no candidates: their host peak" in reason for reason in result.reasons)
    alone = preflight.preflight(SHAPE, GREEDY, 10 * GiB)  # the card alone: those were candidates
    assert any(r.host_peak_bytes is None for r in alone.ranking)
    assert len(alone.ranking) > len(result.ranking)


def test_a_job_that_fits_as_written_still_says_how_many_configs_the_host_ruled_out() -> None:
    """The 8B as written fits a 40 GiB card and a 20 GiB host budget; faster configs that fit the card
    but not the host are counted in the reasons too, not only in ``host_rejected``."""
    result = preflight.preflight(SHAPE, USER, 40 * GiB, host=HostBudget(20 * GiB, CHECKPOINT, "job"))
    assert result.fits and result.fits_as_written
    rejected, _ = result.host_rejected
    assert rejected > 0
    assert any(f"host: {rejected} config(s) that fit the card are no candidates" in r for r in result.reasons)


def test_the_speed_trial_skips_candidates_predicted_far_slower_than_the_chosen() -> None:
    """No trial candidate is predicted at under half the chosen config's tokens/s."""
    result = preflight.preflight(SHAPE, GREEDY, 40 * GiB, host=HostBudget(120 * GiB, CHECKPOINT, "job"))
    first = result.speed_trial[0].predicted_tokens_per_s
    assert first is not None
    assert all(
        (c.predicted_tokens_per_s or 0) >= first * preflight.TRIAL_SLOWEST_SHARE for c in result.speed_trial
    )


def test_nothing_fits_the_host_names_host_memory_and_what_would_fit() -> None:
    """A 3 GiB host budget for the 8B: nothing, host memory named, with the budget that would fit."""
    result = preflight.preflight(SHAPE, USER, 7 * GiB, host=HostBudget(3 * GiB, CHECKPOINT, "flag", GiB))
    assert not result.fits and result.nothing_fits is not None and result.nothing_fits.host
    assert "NOTHING FITS HOST MEMORY" in result.reasons[-1] and "loading the model" in result.reasons[-1]
    assert "a host budget of at least" in result.nothing_fits.help


@pytest.mark.parametrize("need_gib", [3, 17.76, 19.5, 24, 60])
def test_the_smallest_host_for_a_budget_round_trips(need_gib: float) -> None:
    """host_for_budget(need) is the smallest host whose budget (less its reserve) holds ``need``,
    also above ~19 GiB where the reserve is 5 % of the host (a 24 GiB need was once advised a
    25.20 GiB host, whose budget is 23.94 GiB)."""
    need = int(need_gib * GiB)
    smallest = host_for_budget(need)
    assert host_budget(1, 0, host_size=smallest).budget_bytes >= need
    assert host_budget(1, 0, host_size=smallest - 1).budget_bytes < need


def test_the_advised_host_size_as_printed_gives_the_advised_budget() -> None:
    """A need over 19 GiB (a checkpoint in one 24 GiB file, read at load; a 1 GiB host): the "host of
    N GiB" in the advice, given back as --host-memory, is a host budget of the advised one at
    least, and 0.01 GiB less would not be."""
    host = HostBudget(GiB, CHECKPOINT, "flag", GiB, 24 * GiB)
    result = preflight.preflight(SHAPE, USER, 400 * GiB, host=host)
    assert result.nothing_fits is not None and result.nothing_fits.host, result.reasons[-1]
    text = result.nothing_fits.help
    budget = parse_bytes(re.search(r"at least ([\d.]+ GiB)", text).group(1))  # type: ignore[union-attr]
    size = parse_bytes(re.search(r"for a host of ([\d.]+ GiB)", text).group(1))  # type: ignore[union-attr]
    assert budget > 20 * GiB, text
    need = int(result.nothing_fits.smallest_peak * (1 + result.nothing_fits.margin))
    assert abs(budget - need) <= GiB // 200  # as printed, to 0.01 GiB
    assert host_budget(1, 0, host_size=size).budget_bytes >= need
    assert host_budget(1, 0, host_size=size - GiB // 100).budget_bytes < need


# ---- plan: the acceptance on the 8 GB-card user's job ------------------------------------------------


def test_plan_host_memory_24gib_starts_from_a_config_whose_training_host_peak_fits(tmp_path: Path) -> None:
    """`plan --gpu-memory 8GiB --host-memory 24GiB` on the Llama-3-8B job: the start fits the card
    and the host, its training host peak and basis are reported, and so is each candidate's."""
    job = _user_job(tmp_path)
    out = io.StringIO()
    assert plan_command(str(job), gpu_memory="8GiB", as_json=True, out=out, host_memory="24GiB") == 0
    plan = json.loads(out.getvalue())
    host, start = plan["host"], plan["start"]
    assert start["fits"] and start["nothing_fits"] is None and not start["quality_changed"]
    assert host["budget_source"] == "flag" and host["budget_bytes"] == 24 * GiB - host_reserve(24 * GiB)
    assert host["train_peak_bytes"] == start["host_peak_bytes"] <= host["budget_bytes"] / 1.08
    assert host["train_components"]["resident"] == TRAIN_RESIDENT_RSS and "resident" in host["train_basis"]
    assert plan["ranking"] and all(
        r["host_peak_bytes"] <= host["budget_bytes"] / 1.08 for r in plan["ranking"]
    )


def test_plan_with_the_released_shards_fits_a_16gib_host(tmp_path: Path) -> None:
    """With the checkpoint cut in 4 GB files, the 8 GB-card user's 16 GiB PC fits: the load needs
    one shard in the page cache, training 3 GiB with offload; the plan says which phase peaks."""
    job = _user_job(tmp_path, shards=4)
    out = io.StringIO()
    plan_command(str(job), gpu_memory="8GiB", as_json=True, out=out, host_memory="16GiB")
    plan = json.loads(out.getvalue())
    assert plan["start"]["fits"] and plan["start"]["knobs"]["activation_offload"]
    host = plan["host"]
    assert host["train_phase"] == "load"  # imports + one 4.2 GB shard: more than training's 3 GiB
    largest = max(f.stat().st_size for f in (tmp_path / "model").glob("*.safetensors"))
    assert host["train_peak_bytes"] == IMPORTS_RSS + largest
    assert 3 * GiB < host["train_phase_bytes"] < host["train_peak_bytes"] < 6 * GiB < 15 * GiB
    assert host["load_peak_bytes"] > 15 * GiB  # the load's RSS, the mapped checkpoint included


def test_plan_host_memory_4gib_refuses_naming_host_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same job with --host-memory 4GiB: the plan says nothing fits host memory, and what would,
    and exits 6 as `run` would."""
    job = _user_job(tmp_path)
    assert cli.main(["plan", str(job), "--gpu-memory", "8GiB", "--host-memory", "4GiB"]) == 6
    text = capsys.readouterr().out
    assert "NOTHING FITS: HOST MEMORY" in text and "host budget" in text and "at least" in text


def test_a_bad_host_memory_is_a_bad_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--host-memory that is not a size: exit 2, the flag named."""
    assert cli.main(["plan", str(_user_job(tmp_path)), "--host-memory", "plenty"]) == 2
    assert "--host-memory" in capsys.readouterr().err


def test_plan_host_memory_wins_over_the_jobs_limit_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`plan --host-memory` is the explicit what-if: with resources.host_memory_limit set too, the
    flag's budget is planned against and the text names the flag as its source."""
    job = _user_job(tmp_path, "resources: {host_memory_limit: 20GiB}\n")
    out = io.StringIO()
    plan_command(str(job), gpu_memory="8GiB", as_json=True, out=out, host_memory="32GiB")
    host = json.loads(out.getvalue())["host"]
    assert host["budget_source"] == "flag" and host["budget_bytes"] == 32 * GiB - host_reserve(32 * GiB)
    cli.main(["plan", str(job), "--gpu-memory", "8GiB", "--host-memory", "32GiB"])
    assert "(--host-memory less a reserve)" in capsys.readouterr().out


def test_the_jobs_host_memory_limit_is_the_budget(tmp_path: Path) -> None:
    """resources.host_memory_limit is the host budget as it is (no reserve), in plan and in the job."""
    job = _user_job(tmp_path, "resources: {host_memory_limit: 20GiB}\n")
    out = io.StringIO()
    plan_command(str(job), gpu_memory="8GiB", as_json=True, out=out)
    host = json.loads(out.getvalue())["host"]
    assert host["budget_source"] == "job" and host["budget_bytes"] == 20 * GiB


# ---- run: the stop before any child ------------------------------------------------------------------


def test_run_stops_before_any_child_when_nothing_fits_the_host(tmp_path: Path) -> None:
    """A host_memory_limit the 7B cannot load in: exit 6, no attempt, the event names host memory."""
    from test_loop_fake_clock import FakeClock, _run, _seams
    from test_loop_preflight import _llama_job

    from qlora_supervise.supervisor.exit_codes import SupervisorExitCode
    from qlora_supervise.supervisor.record.eventlog import read_events

    job = _llama_job(tmp_path, "24GiB")
    raw = yaml.safe_load(job.read_text())
    raw["resources"]["host_memory_limit"] = "4GiB"
    job.write_text(yaml.safe_dump(raw))
    spawned: list[object] = []
    seams = _seams(FakeClock(), {})
    spawn = seams.spawn
    seams.spawn = lambda *args: spawned.append(args) or spawn(*args)  # type: ignore[func-returns-value]
    assert _run(job, seams) == int(SupervisorExitCode.NOTHING_FITS) and not spawned
    [event] = [e for e in read_events(tmp_path / "run" / "events.jsonl") if e["event"] == "nothing_fits"]
    assert (
        "HOST MEMORY" in event["why"]
        and "4.00 GiB" in event["why"]
        and "no child was started" in event["why"]
    )


# ---- a host OOM kill ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Failure:
    kind: FailureKind
    stage: Stage = Stage.FORWARD
    numbers: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    fatal_xid: int | None = None


def _settings(host_gib: int) -> Settings:
    return Settings(budget_bytes=10 * GiB, shape=SHAPE, host=HostBudget(host_gib * GiB, CHECKPOINT, "job"))


def test_a_host_oom_under_offload_turns_offload_off_and_takes_the_fastest_that_fits_both() -> None:
    """The H200 case: greedy offload killed by the host. Offload goes off, the start is the fastest
    config fitting the 10 GiB card and the host, seq_len and rank untouched; after progress too
    (no plain retry: the child held the host)."""
    killed = dataclasses.replace(GREEDY, micro_batch_size=2, grad_accum=8, activation_offload=True)
    for steps in (0, 12):
        history = [PastAttempt(killed, FailureKind.HOST_OOM, steps, stage=Stage.FORWARD)]
        out = decide(_Failure(FailureKind.HOST_OOM), killed, history, _settings(96))
        assert isinstance(out, Restart), out
        assert not out.knobs.activation_offload and out.rung.startswith("activation_offload_off")
        assert out.knobs.max_seq_len == killed.max_seq_len and out.knobs.lora_r == killed.lora_r
        assert out.knobs.effective_batch == killed.effective_batch
        assert "charged" in out.why


def test_a_host_oom_under_offload_keeps_offload_only_with_less_host_when_nothing_else_fits_the_card() -> None:
    """On a 6 GiB card nothing without offload fits: offload stays, with a config needing less host
    RAM than the one killed (checkpointing), and still no quality change."""
    killed = dataclasses.replace(USER, gradient_checkpointing=False, bf16_head=True, activation_offload=True)
    settings = dataclasses.replace(_settings(96), budget_bytes=6 * GiB)
    history = [PastAttempt(killed, FailureKind.HOST_OOM, 0, stage=Stage.BACKWARD)]
    out = decide(_Failure(FailureKind.HOST_OOM, Stage.BACKWARD), killed, history, settings)
    assert isinstance(out, Restart), out
    assert out.knobs.activation_offload and out.knobs.gradient_checkpointing
    assert out.knobs.max_seq_len == killed.max_seq_len and out.knobs.lora_r == killed.lora_r
    before = host_train_need(SHAPE, killed, CHECKPOINT).train_peak
    assert host_train_need(SHAPE, out.knobs, CHECKPOINT).train_peak < before


def test_a_host_oom_kill_never_turns_activation_offload_on() -> None:
    """The 8B user's config (checkpointing, micro-batch 1) killed twice at the same forward or
    backward step: the ladder walks past offload and the paged optimizer (they add host RAM) to a
    change whose host need is no larger; a job's own host_oom ladder naming offload first is refused
    by the host model the same way."""
    before = host_train_need(SHAPE, USER, CHECKPOINT).train_peak
    for stage in (Stage.FORWARD, Stage.BACKWARD):
        kills = [PastAttempt(USER, FailureKind.HOST_OOM, n, stage=stage, reached=7) for n in (5, 3)]
        for settings in (_settings(96), Settings()):
            out = decide(_Failure(FailureKind.HOST_OOM, stage), USER, kills, settings)
            assert isinstance(out, Restart) and out.rung == "shorten_seq_len", out
            assert host_train_need(SHAPE, out.knobs, CHECKPOINT).train_peak <= before
    own = dataclasses.replace(
        _settings(96), overrides={FailureKind.HOST_OOM: ("activation_offload", "shorten_seq_len")}
    )
    kills = [PastAttempt(USER, FailureKind.HOST_OOM, n, stage=Stage.FORWARD, reached=7) for n in (5, 3)]
    out = decide(_Failure(FailureKind.HOST_OOM), USER, kills, own)
    assert isinstance(out, Restart) and out.rung == "shorten_seq_len" and not out.knobs.activation_offload


@pytest.mark.parametrize(("card_gib", "shard"), [(10, 4_200_000_000), (6, None)])
def test_after_a_card_oom_the_search_and_the_walk_keep_to_the_host_budget(
    card_gib: int, shard: int | None
) -> None:
    """The 8B at seq 8192 with a 6 GiB host budget, killed by the card in the forward: offload (a
    6.25 GiB host need, which the pre-flight refuses) is taken neither by the search (10 GiB card)
    nor by the ladder walk or its one step when nothing is predicted to fit (6 GiB card)."""
    knobs = dataclasses.replace(USER, max_seq_len=8192)
    host = HostBudget(6 * GiB, CHECKPOINT, "job", 0, shard)
    settings = Settings(budget_bytes=card_gib * GiB, shape=SHAPE, host=host)
    history = [PastAttempt(knobs, FailureKind.OOM_FORWARD, 0, stage=Stage.FORWARD)]
    out = decide(_Failure(FailureKind.OOM_FORWARD), knobs, history, settings)
    assert isinstance(out, Restart), out
    need = host_train_need(SHAPE, out.knobs, CHECKPOINT).train_peak
    assert need <= fit_limit(6 * GiB), (out.rung, need / GiB)


def test_host_predictions_count_the_jobs_lora_targets(tmp_path: Path) -> None:
    """A job targeting every linear layer: the settings carry its targets, and the journal's host
    prediction and the host OOM charge count a paged optimizer's state by them."""
    job = load_job(_user_job(tmp_path, "lora: {target_modules: all-linear}\n"))
    settings = policy_settings(job)
    assert settings.targets == "all-linear"
    knobs = dataclasses.replace(USER, optimizer="paged_adamw_8bit")
    checkpoint = settings.host.checkpoint_bytes if settings.host is not None else 0
    wide = host_train_need(SHAPE, knobs, checkpoint, "all-linear").train_peak
    assert wide > host_train_need(SHAPE, knobs, checkpoint).train_peak
    assert predicted_host(settings, knobs) == wide
    assert climb.train_host(SHAPE, knobs, settings) == wide


def test_the_attempts_host_memory_crosses_the_journal() -> None:
    """An attempt's host numbers read back from its journal line as they were written."""
    host = HostMemory(
        peak_bytes=5 * GiB, load_peak_bytes=17 * GiB, last_rss_bytes=4 * GiB, predicted_bytes=5 * GiB
    )
    record = AttemptRecord(
        1, Phase.TRAIN, USER, Outcome.SUCCEEDED, 0.0, 1.0, 0, None, 0, 3, None, 0, host=host
    )
    assert AttemptRecord.from_json(json.loads(record.to_line())).host == host


# ---- what the supervisor reads and shows of an attempt's host RAM ----------------------------------


def _host_beat(stage: Stage, step: int, rss: int, high_water: int) -> str:
    from qlora_supervise.trainer_child.contract.events import Heartbeat, MemoryNumbers

    memory = MemoryNumbers.measured(cuda_peak=1, data_segment_peak=None, rss_high_water=high_water, rss=rss)
    return Heartbeat(stage, step, None, None, memory).to_line()


def test_the_reader_keeps_the_loads_and_trainings_host_peaks_apart(tmp_path: Path) -> None:
    """The load's high-water mark comes from ``loaded``; training's from the heartbeats after it,
    restarted at the speed trial (its candidates are not the trained config); the last RSS is kept."""
    from qlora_supervise.supervisor.watching.watch import HeartbeatReader
    from qlora_supervise.trainer_child.contract.events import (
        MemoryNumbers,
        SpeedTrialEvent,
        TrialResult,
        event_line,
    )
    from qlora_supervise.trainer_child.contract.spec import TrialCandidate

    chosen = TrialCandidate(1, 8, True)
    trial = SpeedTrialEvent((TrialResult(chosen, 5.0, 1, 1.0, None, 6 * GiB),), 1.0)
    lines = [
        _host_beat(Stage.LOAD, 0, 12 * GiB, 16 * GiB),
        event_line(
            "loaded",
            **MemoryNumbers.measured(cuda_peak=1, data_segment_peak=None, rss_high_water=16 * GiB).fields(),
        ),
        _host_beat(Stage.FORWARD, 0, 5 * GiB, 6 * GiB),  # a trial candidate
        trial.to_line(),
        _host_beat(Stage.BACKWARD, 1, 3 * GiB, 3 * GiB + 5),
        _host_beat(Stage.OPTIMIZER, 2, 2 * GiB, 3 * GiB + 9),
    ]
    (tmp_path / "events.jsonl").write_text("".join(lines))
    reader = HeartbeatReader(tmp_path / "events.jsonl")
    reader.poll(now=1.0)
    p = reader.progress
    assert (p.load_host_peak, p.host_peak, p.last_rss) == (16 * GiB, 3 * GiB + 9, 2 * GiB)


def test_a_host_oom_kill_carries_the_rss_at_the_kill_and_status_shows_host_against_prediction() -> None:
    """failure_record adds the last heartbeat's RSS and training's host peak to a host_oom (not to
    other kinds); status prints an attempt's host RAM beside the host model's prediction."""
    from qlora_supervise.supervisor.commands.status import host_line
    from qlora_supervise.supervisor.facts.failure import Failure
    from qlora_supervise.supervisor.loop.outcome import failure_record
    from qlora_supervise.supervisor.watching.watch import Progress

    progress = Progress(host_peak=40 * GiB, last_rss=39 * GiB)
    kill = failure_record(Failure(FailureKind.HOST_OOM, Stage.FORWARD, {}, "oom_kill +1"), None, progress)
    assert kill.numbers == {"rss_at_kill": 39 * GiB, "host_peak": 40 * GiB}
    other = failure_record(Failure(FailureKind.OOM_FORWARD, Stage.FORWARD, {}, "cuda"), None, progress)
    assert other.numbers == {}
    host = HostMemory(
        peak_bytes=3 * GiB, load_peak_bytes=16 * GiB, last_rss_bytes=3 * GiB, predicted_bytes=3 * GiB
    )
    record = AttemptRecord(
        1, Phase.TRAIN, USER, Outcome.SUCCEEDED, 0.0, 1.0, 0, None, 0, 3, None, 0, host=host
    )
    line = host_line(record)
    assert (
        line is not None
        and "training peak 3.00 GiB (predicted 3.00 GiB)" in line
        and "load peak 16.00 GiB" in line
    )
    assert host_line(dataclasses.replace(record, host=None)) is None


def test_each_journalled_attempt_carries_the_host_models_prediction_for_what_it_trained(
    tmp_path: Path,
) -> None:
    """A run (scripted child, fake clock) journals its attempt's host prediction for the knobs it
    trained with, which status and explain set beside the measured peak."""
    from test_loop_fake_clock import LLAMA2_7B, FakeClock, _run, _seams
    from test_loop_preflight import _llama_job

    assert _run(_llama_job(tmp_path, "24GiB"), _seams(FakeClock(), {})) == 0
    [line] = (tmp_path / "run" / "attempts.jsonl").read_text().splitlines()
    record = AttemptRecord.from_json(json.loads(line))
    shape = ModelShape.from_config({**LLAMA2_7B, "model_type": "llama"})
    assert record.host is not None
    assert record.host.predicted_bytes == host_train_need(shape, record.knobs, shape.params * 2).train_peak


def test_without_a_limit_the_run_plans_against_what_the_host_has_available(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No host_memory_limit: the budget is the RAM available now less the reserve; a host with
    3 GiB free cannot take the 7B, and the run stops before any child, naming host memory."""
    from test_loop_fake_clock import FakeClock, _run, _seams
    from test_loop_preflight import _llama_job

    from qlora_supervise.supervisor.exit_codes import SupervisorExitCode
    from qlora_supervise.supervisor.record.eventlog import read_events
    from qlora_supervise.supervisor.watching import host

    monkeypatch.setattr(host, "host_room", lambda: (3 * GiB, None))
    assert _run(_llama_job(tmp_path, "24GiB"), _seams(FakeClock(), {})) == int(
        SupervisorExitCode.NOTHING_FITS
    )
    [event] = [e for e in read_events(tmp_path / "run" / "events.jsonl") if e["event"] == "nothing_fits"]
    assert "HOST MEMORY" in event["why"] and "2.00 GiB" in event["why"]  # 3 GiB less the 1 GiB reserve
