"""train.report_to passes through to the Trainer, with one TensorBoard directory for every attempt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _child import child_env, make_spec, write_spec

from qlora_supervise.supervisor.jobfile import JobError, load_job

CHECK = Path(__file__).with_name("report_to_check.py")


def _recipe_view(spec_path: Path, fake_tensorboard: Path | None) -> dict[str, object]:
    env = child_env()
    if fake_tensorboard is not None:  # find_spec("tensorboard") sees a package: the recipe's check passes
        env["PYTHONPATH"] = os.pathsep.join([str(fake_tensorboard), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(CHECK), str(spec_path)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    value: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return value


@pytest.mark.slow
def test_tensorboard_reaches_the_trainer_with_one_log_dir_across_attempts(tmp_path: Path) -> None:
    """report_to tensorboard: SFTConfig gets it, and attempts 1 and 2 log to <run_dir>/tensorboard."""
    fake = tmp_path / "site"
    (fake / "tensorboard").mkdir(parents=True)
    (fake / "tensorboard" / "__init__.py").write_text("")
    run_dir = tmp_path / "run"
    views = []
    for attempt in (1, 2):
        spec = make_spec(tmp_path / "tiny", run_dir, attempt, train={"report_to": "tensorboard"})
        views.append(_recipe_view(write_spec(spec), fake))
    assert views[0]["report_to"] == ["tensorboard"]
    assert views[0]["env"] == views[1]["env"] == {"TENSORBOARD_LOGGING_DIR": str(run_dir / "tensorboard")}


@pytest.mark.slow
def test_report_to_none_is_the_default_and_sets_nothing(tmp_path: Path) -> None:
    """Without the setting, the Trainer reports nowhere and no log directory is chosen."""
    spec = make_spec(tmp_path / "tiny", tmp_path / "run")
    assert spec.train.report_to == "none"
    assert _recipe_view(write_spec(spec), None) == {"report_to": [], "env": {}}


@pytest.mark.slow
def test_tensorboard_missing_is_a_config_error_naming_the_install(tmp_path: Path) -> None:
    """report_to tensorboard without tensorboard installed says how to install it (or turn it off)."""
    try:
        import tensorboard  # noqa: F401

        pytest.skip("tensorboard is installed here")
    except ImportError:
        pass
    spec = make_spec(tmp_path / "tiny", tmp_path / "run", train={"report_to": "tensorboard"})
    error = str(_recipe_view(write_spec(spec), None)["error"])
    assert "pip install tensorboard" in error and "report_to: none" in error


def test_the_job_file_accepts_tensorboard_and_none_only(tmp_path: Path) -> None:
    """train.report_to is tensorboard or none; anything else is a problem at that field."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    job = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "train": {"report_to": "tensorboard"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert load_job(tmp_path / "job.yaml").train.report_to == "tensorboard"
    job["train"] = {"report_to": "wandb"}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    with pytest.raises(JobError) as caught:
        load_job(tmp_path / "job.yaml")
    assert any(p.path == "train.report_to" for p in caught.value.problems)
