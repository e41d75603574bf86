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


def _wheel_venv(tmp_path: Path) -> Path:
    """A fresh venv outside the clone with only the built wheel installed (``--no-deps``); its
    dependencies come from this venv's site-packages through a ``.pth`` line, to stay offline."""
    import site
    import sys
    import sysconfig

    root = Path(__file__).resolve().parents[1]
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(root)], check=True
    )
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    wheel = next(wheels.glob("qlora_supervise-*.whl"))
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", "-q", str(wheel)], check=True)
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # A plain path line: the editable install's own .pth in this venv is not run from there.
    ours = site.getsitepackages()[0] if site.getsitepackages() else sysconfig.get_paths()["purelib"]
    (Path(purelib) / "_deps_from_test_venv.pth").write_text(ours + "\n")
    return venv


@pytest.mark.slow
def test_install_systemd_works_from_an_installed_wheel(tmp_path: Path) -> None:
    """Issue 21 item 11: the wheel carries the unit template and env example; its
    `qlora-supervise install-systemd --root` writes them, run from outside the clone."""
    venv = _wheel_venv(tmp_path)
    where = subprocess.run(
        [str(venv / "bin/python"), "-c", "import qlora_supervise.supervisor as s; print(s.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout
    assert where.startswith(str(venv)), where  # the wheel's code, not the clone's
    job, root = _job(tmp_path), tmp_path / "root"
    done = subprocess.run(
        [
            str(venv / "bin/qlora-supervise"),
            "install-systemd",
            str(job),
            "--root",
            str(root),
            "--service-user",
            "lab",
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    unit = root / "etc/systemd/system/qlora-supervise@.service"
    assert "User=lab" in unit.read_text() and "install from the clone" not in done.stderr
    template = (SYSTEMD / "qlora-supervise@.service").read_text()
    assert unit.read_text().count("ProtectSystem=strict") == template.count("ProtectSystem=strict") == 1
    env = root / "etc/qlora-supervise/qlora-supervise.env"
    assert env.read_text() == (SYSTEMD / "qlora-supervise.env.example").read_text()
