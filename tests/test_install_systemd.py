"""install-systemd into a temporary root, and systemd-analyze verify on the units it writes."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from qlora_supervise.supervisor.commands.cli import main

SYSTEMD = Path(__file__).resolve().parents[1] / "systemd"
needs_systemd = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed"
)


def _job(tmp_path: Path) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "data.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    job = {
        "model": {"path": "model"},
        "data": {"path": "data.jsonl"},
        "supervise": {"stop_grace": "4m"},
        "output_dir": "run",
    }
    path = tmp_path / "myjob.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _verify(unit: Path, tmp_path: Path) -> str:
    """systemd-analyze verify of an instance of the template; its complaints about our file."""
    work = tmp_path / "verify"
    work.mkdir(exist_ok=True)
    instance = work / "qlora-supervise@myjob.service"
    instance.write_text(unit.read_text())
    done = subprocess.run(
        ["systemd-analyze", "verify", str(instance)], capture_output=True, text=True, check=False
    )
    return "\n".join(line for line in (done.stdout + done.stderr).splitlines() if str(instance) in line)


@needs_systemd
def test_the_repository_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    """systemd-analyze verify finds nothing to say about the template (unknown keys, bad values)."""
    assert _verify(SYSTEMD / "qlora-supervise@.service", tmp_path) == ""


def test_install_writes_unit_job_and_env_under_the_root_and_refuses_to_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--system --root writes the rendered unit, the job with absolute paths and the env file; a
    second install without --force exits 2 and changes nothing; --force replaces."""
    job, root = _job(tmp_path), tmp_path / "root"
    argv = ["install-systemd", str(job), "--system", "--root", str(root), "--service-user", "lab"]
    assert main(argv) == 0
    unit = root / "etc/systemd/system/qlora-supervise@.service"
    copy = root / "etc/qlora-supervise/myjob.yaml"
    assert (root / "etc/qlora-supervise/qlora-supervise.env").is_file()
    text = unit.read_text()
    assert "User=lab" in text and "Group=lab" in text
    assert "TimeoutStopSec=360" in text  # stop_grace 4m + 120 s
    assert f"ReadWritePaths={tmp_path / 'run'}" in text
    assert "ProtectSystem=strict" in text and "NoNewPrivileges=yes" in text
    installed = yaml.safe_load(copy.read_text())
    assert installed["model"]["path"] == str(tmp_path / "model")
    assert installed["output_dir"] == str(tmp_path / "run")
    out = capsys.readouterr().out
    assert (
        "sudo systemctl enable --now qlora-supervise@myjob" in out
        and "journalctl -u qlora-supervise@myjob" in out
    )

    copy.write_text("# edited by the admin\n")
    assert main(argv) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert copy.read_text() == "# edited by the admin\n"
    assert main([*argv, "--force"]) == 0
    assert "installed by qlora-supervise" in copy.read_text()


def test_user_install_drops_what_a_user_manager_cannot_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--user writes under $XDG_CONFIG_HOME, with no User=, no device or mount sandboxing, %E paths."""
    job, root = _job(tmp_path), tmp_path / "root"
    monkeypatch.setenv("XDG_CONFIG_HOME", "/home/lab/.config")
    assert main(["install-systemd", str(job), "--user", "--root", str(root)]) == 0
    unit = root / "home/lab/.config/systemd/user/qlora-supervise@.service"
    text = unit.read_text()
    assert "User=" not in text and "DeviceAllow" not in text and "ProtectSystem" not in text
    assert "%E/qlora-supervise/%i.yaml" in text and "WantedBy=default.target" in text
    assert (root / "home/lab/.config/qlora-supervise/myjob.yaml").is_file()


@needs_systemd
def test_installed_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    """The rendered system and user units are as clean for systemd-analyze as the template."""
    job = _job(tmp_path)
    assert main(["install-systemd", str(job), "--root", str(tmp_path / "s"), "--service-user", "lab"]) == 0
    assert _verify(tmp_path / "s/etc/systemd/system/qlora-supervise@.service", tmp_path) == ""
