"""The systemd unit agrees with the supervisor's exit codes and stop behaviour."""

from __future__ import annotations

from pathlib import Path

from qlora_supervise.supervisor.exit_codes import SupervisorExitCode
from qlora_supervise.supervisor.loop.arbiter import Seams

SYSTEMD = Path(__file__).resolve().parents[1] / "systemd"


def _unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (systemd allows repeated keys, so every value is kept)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def _one(values: list[str]) -> str:
    assert len(values) == 1, values
    return values[0]


SERVICE = _unit(SYSTEMD / "qlora-supervise@.service")["Service"]


def test_restart_prevent_exit_status_matches_exit_codes() -> None:
    """Finished, bad job, gave up, not retryable and a GPU fault are the codes systemd must not restart on."""
    prevented = {int(code) for code in _one(SERVICE["RestartPreventExitStatus"]).split()}
    c = SupervisorExitCode
    assert prevented == {c.FINISHED, c.BAD_JOB, c.GAVE_UP, c.NOT_RETRYABLE, c.GPU_FAULT}
    assert _one(SERVICE["Restart"]) == "on-failure"


def test_signal_stops_are_clean() -> None:
    """Exit codes for SIGINT / SIGTERM stops count as success, so `systemctl stop` leaves no failed unit."""
    success = {int(code) for code in _one(SERVICE["SuccessExitStatus"]).split()}
    assert success == {SupervisorExitCode.STOPPED_SIGINT, SupervisorExitCode.STOPPED_SIGTERM}


def test_stop_reaches_the_supervisor_first_with_time_to_checkpoint() -> None:
    """SIGTERM goes to the supervisor only, and the stop timeout outlasts its grace period for the child."""
    assert _one(SERVICE["KillMode"]) == "mixed"
    assert _one(SERVICE["KillSignal"]) == "SIGTERM"
    assert int(_one(SERVICE["TimeoutStopSec"])) > Seams().stop_grace_s


def test_notify_and_oom_settings() -> None:
    """Type=notify with main-only access, and kernel OOM kills left to the supervisor."""
    assert _one(SERVICE["Type"]) == "notify"
    assert _one(SERVICE["NotifyAccess"]) == "main"
    assert _one(SERVICE["OOMPolicy"]) == "continue"
    assert "PYTHONUNBUFFERED=1" in SERVICE["Environment"]
    exec_start = _one(SERVICE["ExecStart"])
    assert "qlora-supervise run" in exec_start and "/etc/qlora-supervise/%i.yaml" in exec_start


def test_environment_example_is_key_value_lines() -> None:
    """Every active line of the environment example is KEY=value, as EnvironmentFile= reads it."""
    lines = (SYSTEMD / "qlora-supervise.env.example").read_text().splitlines()
    active = [line for line in lines if line.strip() and not line.startswith("#")]
    assert active and all("=" in line and not line.startswith("export ") for line in active)
    assert {line.split("=", 1)[0] for line in active} >= {"HF_HOME", "HF_HUB_OFFLINE", "CUDA_VISIBLE_DEVICES"}
