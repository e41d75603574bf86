"""The folders no ``output_dir`` may be: ``/``, a home directory, the system's own folders (the
supervisor, often root, moves and deletes a run directory's entries). Compared after links resolve."""

from __future__ import annotations

import contextlib
import os
import pwd
from pathlib import Path

#: Trees no run directory may be in: the kernel's, the devices', the system's own files.
SYSTEM_TREES = ("/proc", "/sys", "/dev", "/run", "/boot", "/etc", "/usr", "/bin", "/sbin", "/lib", "/lib64")
#: Folders that are never a run directory themselves (a run in a folder under them is fine).
SYSTEM_FOLDERS = ("/", "/var", "/var/lib", "/var/tmp", "/tmp", "/opt", "/srv", "/home", "/root", "/mnt")
OWN_FOLDER = "choose a folder of your own for output_dir (for example /srv/runs/NAME, or one in your home)"


def system_folder(path: Path) -> tuple[str, str] | None:
    """Why ``path`` is no place for a run directory, and the fix; None when it may be one."""
    real = Path(os.path.realpath(path))
    shown = "" if real == path else f" (it resolves to {real})"
    for tree in map(Path, SYSTEM_TREES):
        if real == tree or tree in real.parents:
            return f"is in the system folder {tree}{shown}", OWN_FOLDER
    if str(real) in SYSTEM_FOLDERS:
        return f"is the system folder {real}{shown}; a run directory is a folder of its own", OWN_FOLDER
    homes = {Path(os.path.realpath(Path.home()))}  # and every account's: a unit may run as another
    with contextlib.suppress(OSError):
        homes |= {Path(os.path.realpath(entry.pw_dir)) for entry in pwd.getpwall() if entry.pw_dir}
    if real in homes:
        fix = f"choose a folder of your own for output_dir (for example {real}/runs/NAME)"
        return f"is a home directory{shown}; a run directory is a folder of its own", fix
    return None
