"""The systemd unit agrees with the supervisor's exit codes and stop behaviour."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

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
    """Every verdict of `run` (finished, bad job, gave up, not retryable, GPU fault, nothing fits)."""
    prevented = {int(code) for code in _one(SERVICE["RestartPreventExitStatus"]).split()}
    c = SupervisorExitCode
    assert prevented == {c.FINISHED, c.BAD_JOB, c.GAVE_UP, c.NOT_RETRYABLE, c.GPU_FAULT, c.NOTHING_FITS}
    # every verdict of `run` is in the set: only a stop (130/143) or a crash may restart
    assert prevented == {int(code) for code in c if int(code) not in (130, 143)}
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


#: Directive -> value the hardening needs (issue 21 item 10: `systemd-analyze security` <= 4.0).
HARDENING = {
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "read-only",
    "PrivateTmp": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes",
    "ProtectClock": "yes",
    "ProtectHostname": "yes",
    "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes",
    "CapabilityBoundingSet": "",
    "RestrictNamespaces": "yes",
    "RestrictRealtime": "yes",
    "SystemCallArchitectures": "native",
    "UMask": "0027",
    "DevicePolicy": "closed",
}


def test_the_unit_carries_the_hardening_directives() -> None:
    """Every hardening directive is set, the address families and system calls are restricted."""
    missing = {key: want for key, want in HARDENING.items() if SERVICE.get(key) != [want]}
    assert missing == {}
    assert set(_one(SERVICE["RestrictAddressFamilies"]).split()) == {
        "AF_UNIX",
        "AF_INET",
        "AF_INET6",
        "AF_NETLINK",
    }
    denied = _one(SERVICE["SystemCallFilter"])
    assert denied.startswith("~") and {"@mount", "@module", "@reboot", "@raw-io"} <= set(denied[1:].split())
    assert _one(SERVICE["SystemCallErrorNumber"]) == "EPERM"


def test_the_hardening_still_allows_what_the_trainer_needs() -> None:
    """The GPU nodes, the HF cache (StateDirectory) and the run directory stay reachable, and
    nothing that hides the GPU nodes or breaks JIT code is set."""
    allowed = {value.split()[0] for value in SERVICE["DeviceAllow"]}
    assert {"char-nvidia-frontend", "char-nvidia-uvm", "char-nvidia-caps"} <= allowed
    assert all(value.split()[1] == "rw" for value in SERVICE["DeviceAllow"])
    assert _one(SERVICE["StateDirectory"]) == "qlora-supervise"
    assert "-/srv/qlora" in SERVICE["ReadWritePaths"]
    for key in ("PrivateDevices", "PrivateUsers", "PrivateNetwork", "MemoryDenyWriteExecute", "ProcSubset"):
        assert SERVICE.get(key, ["no"]) == ["no"], key
    env = (SYSTEMD / "qlora-supervise.env.example").read_text()
    assert "HF_HOME=/var/lib/qlora-supervise/" in env  # inside the StateDirectory, writable


def _exposure(unit: Path, tmp_path: Path) -> float:
    import re
    import subprocess

    instance = tmp_path / "qlora-supervise@myjob.service"
    instance.write_text(unit.read_text())
    done = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", str(instance)],
        capture_output=True,
        text=True,
        check=False,
    )
    if "offline" in done.stderr and ("unrecognized" in done.stderr or "Unknown" in done.stderr):
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", done.stdout + done.stderr)
    assert found, done.stdout + done.stderr
    return float(found.group(1))


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed on this machine"
)
def test_systemd_analyze_security_rates_the_unit_4_or_less(tmp_path: Path) -> None:
    """`systemd-analyze security --offline=yes` gives the template an exposure of 4.0 or less (it was 7.6)."""
    assert _exposure(SYSTEMD / "qlora-supervise@.service", tmp_path) <= 4.0
