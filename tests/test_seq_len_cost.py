"""shorten_seq_len says what it costs: samples truncated and tokens lost, from the child's lengths."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from test_loop_fake_clock import FakeChild, FakeClock, _job, _run, _seams

from qlora_supervise.policies.decide import Restart, Settings, decide
from qlora_supervise.policies.rungs import truncation_cost
from qlora_supervise.supervisor.facts.failure import Failure
from qlora_supervise.supervisor.loop.child import Seams
from qlora_supervise.supervisor.loop.settings import with_sample_lengths
from qlora_supervise.supervisor.record.eventlog import read_events
from qlora_supervise.supervisor.record.journal import read_attempts
from qlora_supervise.trainer_child.contract.attempt_facts import SampleLengths
from qlora_supervise.trainer_child.contract.codes import FailureKind, Stage
from qlora_supervise.trainer_child.contract.events import Loaded, Started, event_line, parse_event
from qlora_supervise.trainer_child.contract.spec import Knobs

# 20 samples: 10 of 50 tokens, 6 of 100, 4 of 200 (1900 tokens). At 128 the four longest lose 72 each.
LENGTHS = SampleLengths(20, tuple([50] * 10 + [100] * 6 + [200] * 4))
AT_128 = "4 of 20 samples truncated, 15.2 % of tokens lost at max_seq_len 128 (at 256: 0, 0.0 %)"


def test_truncation_cost_counts_samples_and_the_token_share_beyond_the_length() -> None:
    """At 128 four samples are cut and 288 of 1900 tokens lost; at 256 nothing is."""
    cost = truncation_cost(LENGTHS, 128)
    assert (cost.truncated, cost.rows, cost.exact) == (4, 20, True)
    assert cost.tokens_lost == 288 / 1900
    assert truncation_cost(LENGTHS, 256).truncated == 0 and truncation_cost(LENGTHS, 256).tokens_lost == 0.0
    assert truncation_cost(LENGTHS, 49).truncated == 20


def test_a_sample_of_the_lengths_is_scaled_to_all_rows_and_says_about() -> None:
    """Lengths of 4 of 400 rows, one of them long: about 100 of 400 samples truncated."""
    cost = truncation_cost(SampleLengths(400, (10, 10, 10, 300)), 128)
    assert (cost.truncated, cost.exact) == (100, False)
    assert cost.text().startswith("about 100 of 400 samples truncated, ")


def test_the_policy_puts_the_cost_into_the_shorten_rungs_reason() -> None:
    """With the lengths in Settings, the restart's why names the samples truncated and tokens lost."""
    knobs = Knobs(
        model="/m",
        micro_batch_size=1,
        grad_accum=8,
        max_seq_len=256,
        gradient_checkpointing=True,
        activation_offload=True,  # the forward ladder's rungs before shorten_seq_len are all taken
    )
    failure = Failure(FailureKind.OOM_FORWARD, Stage.FORWARD, {}, "evidence", "message")
    decision = decide(failure, knobs, [], Settings(sample_lengths=LENGTHS))
    assert isinstance(decision, Restart) and decision.rung == "shorten_seq_len"
    assert decision.why.endswith(AT_128), decision.why
    without = decide(failure, knobs, [], Settings())
    assert isinstance(without, Restart) and "samples truncated" not in without.why


def test_sample_lengths_round_trip_and_torn_events_read_as_none() -> None:
    """The typed field survives the events file; an event without it has none, one with bad values is None."""
    loaded = parse_event({"event": "loaded", **LENGTHS.fields()})
    assert isinstance(loaded, Loaded) and loaded.sample_lengths == LENGTHS
    none = parse_event({"event": "loaded", "train_rows": 20})
    assert isinstance(none, Loaded) and none.sample_lengths is None
    assert parse_event({"event": "loaded", "sample_lengths": {"rows": 2, "lengths": [1, "x"]}}) is None


def test_settings_take_the_latest_loaded_lengths_and_keep_earlier_ones_otherwise() -> None:
    """The attempt's loaded event sets the lengths; an attempt without one leaves the previous ones."""
    settings = with_sample_lengths(Settings(), [Started(), Loaded(sample_lengths=LENGTHS)])
    assert settings.sample_lengths == LENGTHS
    assert with_sample_lengths(settings, [Started()]).sample_lengths == LENGTHS


def _seams_with_loaded(clock: FakeClock, plan: Mapping[int, str]) -> Seams:
    """The fake-clock seams, each fake child first writing a ``loaded`` event with the lengths."""
    seams = _seams(clock, plan)
    spawn = seams.spawn

    def spawn_loaded(argv: Sequence[str], env: Mapping[str, str], log_path: Path, cwd: Path) -> Any:
        child = spawn(argv, env, log_path, cwd)
        assert isinstance(child, FakeChild)
        events = Path(child.spec.events_file)
        events.parent.mkdir(parents=True, exist_ok=True)
        with events.open("a", encoding="utf-8") as out:
            out.write(event_line("loaded", train_rows=20, **LENGTHS.fields()))
        return child

    return dataclasses.replace(seams, spawn=spawn_loaded)


def test_the_journal_and_the_retry_line_say_what_the_shorter_seq_len_cuts(tmp_path: Path) -> None:
    """Forward OOMs at micro 1 with checkpointing take activation offload, then shorten seq_len, and
    that why carries the cost."""
    job = _job(tmp_path)
    raw = yaml.safe_load(job.read_text())
    raw["train"].update(micro_batch_size=1, gradient_checkpointing=True)
    job.write_text(yaml.safe_dump(raw))
    assert _run(job, _seams_with_loaded(FakeClock(), {1: "oom@3", 2: "oom@4"})) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert records[0].decision is not None and records[0].decision.rung == "activation_offload"
    decision = records[1].decision
    assert decision is not None and decision.rung == "shorten_seq_len"
    assert decision.why.endswith(AT_128), decision.why
    retries = [e for e in read_events(tmp_path / "run" / "events.jsonl") if e["event"] == "retry"]
    assert retries[1]["why"] == decision.why  # the second retry: the first took activation offload
