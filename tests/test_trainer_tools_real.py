"""axolotl itself, in a venv of its own, supervised on the tiny model under a real CPU memory cap.

The venv is built by the test (``tests/_tool_venvs.py``: this machine's torch, axolotl 0.19.0's
pins, then axolotl; about 90 s the first time, then kept under ``.tool-venvs/``), or the test is
skipped saying why. The child is axolotl's own ``python -m axolotl.cli.train attempt-NNN/axolotl.yaml``
in that venv, with the shim on its PYTHONPATH: the OOM is torch's ``DefaultCPUAllocator: can't
allocate memory`` inside axolotl's trainer, the report and the emergency checkpoint come from the
shim, and the new knobs reach axolotl through the attempt's config alone.

LLaMA-Factory 0.9.5 is not built here: it imports ``torchaudio`` at module level
(``llamafactory/data/mm_plugin.py``), and the newest torchaudio (2.11) is built against torch 2.11,
so its library does not load beside the torch 2.13 of these machines. It ran, supervised, on one
H200 with torch 2.11 (``python -m bench.trainers.foreign_trainers --tool llamafactory``;
docs/trainers.md, "What was checked").
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import yaml
from _machine import import_baseline
from _resume_checks import assert_loss_continues, assert_same_samples_per_step, read_lines
from _tool_venvs import AXOLOTL, tool_python
from _trainer_configs import axolotl_config

from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.commands.status import status_command
from qlora_supervise.supervisor.record.eventlog import read_events
from qlora_supervise.supervisor.record.journal import read_attempts

pytestmark = pytest.mark.slow

MIB = 1 << 20
#: Above the axolotl venv's stack baseline: micro-batch 8 at seq 256 needs 375-450 MiB of it once
#: axolotl has loaded the tiny model, micro-batch 16 needs 525-600 (measured on this machine kind
#: with the venv's pins, the cap landing after step 1), so this sits in the middle of the gap.
AXOLOTL_HEADROOM = 490 * MIB


def test_axolotl_oom_restarts_at_half_the_micro_batch_and_resumes_in_order(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real OOM in axolotl's step 2 resumes from step 1 at micro-batch 8 x 2, the same samples."""
    python = tool_python(AXOLOTL)
    cap = import_baseline(str(python)) + AXOLOTL_HEADROOM
    # Injected timing, real failure: the cap lands after step 1, so step 2 runs out of memory.
    monkeypatch.setenv("QLORA_SUPERVISE_TEST_CAP_AFTER_STEP", "1")
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("QLORA_SUPERVISE_TEST_TRACE_BATCHES", str(trace))
    monkeypatch.setenv("AXOLOTL_DO_NOT_TRACK", "1")  # its telemetry would try the network
    user_file = yaml.safe_dump(axolotl_config(tiny_dir, tmp_path), sort_keys=False)
    (tmp_path / "axolotl.yaml").write_text(user_file)
    halve = ["halve_micro_batch"]
    job = {
        "trainer": {"kind": "axolotl", "config": "axolotl.yaml", "python": str(python)},
        "resources": {"gpu": "cpu", "cpu_memory_limit": f"{cap}B"},
        "supervise": {"hang_timeout": "5m", "backoff_initial": "0.1s", "backoff_max": "1s",
                      "ladders": {"oom_forward": halve, "oom_backward": halve}},
        "output_dir": "./run",
    }  # fmt: skip
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    assert run_job(str(tmp_path / "job.yaml"), plain=True, console=io.StringIO(), install_signals=False) == 0

    run = tmp_path / "run"
    records, bad = read_attempts(run / "attempts.jsonl")
    assert bad == 0 and [r.outcome for r in records] == ["failed", "succeeded"]
    first, second = records
    assert first.failure is not None and first.failure.kind in ("oom_forward", "oom_backward")
    assert first.failure.stage in ("forward", "backward") and "error report" in first.failure.evidence
    assert "DefaultCPUAllocator" in first.failure.message
    assert first.steps_completed == 1 and second.resumed_from == 1 and second.steps_completed == 3
    assert first.failure.emergency_checkpoint == str(run / "checkpoints" / "checkpoint-1")
    assert (second.knobs.micro_batch_size, second.knobs.grad_accum) == (8, 2)
    assert second.knobs.effective_batch == first.knobs.effective_batch == 16
    # The new knobs reached axolotl through attempt 2's own config; the user's file is untouched.
    config = yaml.safe_load((run / "attempt-002" / "axolotl.yaml").read_text())
    assert config["micro_batch_size"] == 8 and config["gradient_accumulation_steps"] == 2
    assert config["resume_from_checkpoint"] == str(run / "checkpoints" / "checkpoint-1")
    assert config["a_key_we_do_not_know"] == {"kept": [1, 2]}
    assert (tmp_path / "axolotl.yaml").read_text() == user_file
    # It was axolotl's own process, in its venv.
    events = read_lines(run / "attempt-001" / "child-events.jsonl")
    started = next(e for e in events if e["event"] == "started")
    assert started["versions"]["axolotl"] == AXOLOTL.version
    # Data order: without sample packing axolotl's Trainer draws transformers' seeded permutation,
    # so the resumed step 2 trains the samples it began with; its history goes on (axolotl rounds
    # the losses it logs to four digits).
    assert_same_samples_per_step(trace)
    assert_loss_continues(run, rel=1e-3)
    assert "shim_not_attached" not in [e["event"] for e in read_events(run / "events.jsonl")]
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    out = io.StringIO()
    assert status_command([str(run)], out=out) == 0
    assert "micro_batch_size: 16 -> 8; gradient_accumulation_steps: 1 -> 2" in out.getvalue()
