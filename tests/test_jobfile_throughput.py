"""Job fields of issue 19: ``supervise.speed_trial``, and a clear refusal of the ``cpu_offload`` rung."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_loop_fake_clock import _job

from qlora_supervise.supervisor.jobfile import JobError, load_job
from qlora_supervise.supervisor.loop.settings import policy_settings


def test_speed_trial_is_on_by_default_and_can_be_turned_off(tmp_path: Path) -> None:
    """``supervise.speed_trial`` defaults to true and reaches the policy's settings; false turns it off."""
    on = load_job(str(_job(tmp_path)))
    assert on.supervise.speed_trial and policy_settings(on).speed_trial
    off = load_job(str(_job(tmp_path, speed_trial=False)))
    assert not off.supervise.speed_trial and not policy_settings(off).speed_trial


def test_a_ladder_naming_cpu_offload_is_refused_with_the_reason(tmp_path: Path) -> None:
    """cpu_offload cannot train 4-bit weights: validation says why and names what to use instead."""
    with pytest.raises(JobError) as error:
        load_job(str(_job(tmp_path, ladders={"oom_load": ["quantize_4bit", "cpu_offload"]})))
    text = "\n".join(problem.render() for problem in error.value.problems)
    assert "accelerate refuses to train 4-bit weights" in text and "meta tensors" in text
    assert "activation_offload" in text
