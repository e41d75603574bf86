"""A hook's output is read bounded (issue 29 item 6): the real supervisor, a hook printing hundreds of
MB, the supervisor's peak memory measured in its own process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_loop import _job

RUNNER = Path(__file__).with_name("run_scripted.py")
#: Runs the scripted runner in this process and reports its peak RSS (children not counted).
MEASURED = (
    "import runpy, sys\n"
    "sys.argv = sys.argv[1:]\n"
    "try:\n"
    "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
    "    code = 0\n"
    "except SystemExit as stop:\n"
    "    code = stop.code\n"
    # VmHWM: this process's own peak since its exec (ru_maxrss also counts the parent's at the fork)
    "hwm = open('/proc/self/status').read().split('VmHWM:')[1].split()[0]\n"
    "print(f'maxrss_kb={hwm}', file=sys.stderr)\n"
    "sys.exit(code)\n"
)
#: 400 MB on stdout and on stderr in 1 MB writes, then the line a person needs, then exit 3.
LOUD_HOOK = (
    "import sys\n"
    "block = b'x' * (1 << 20)\n"
    "for _ in range(400):\n"
    "    sys.stdout.buffer.write(block)\n"
    "    sys.stderr.buffer.write(block)\n"
    "sys.stderr.buffer.write(b'\\nthe webhook answered 503\\n')\n"
    "sys.exit(3)\n"
)


def test_a_hook_printing_800_mb_costs_the_supervisor_little_memory_and_its_last_line_is_kept(
    tmp_path: Path,
) -> None:
    """A hook writing 800 MB: the run succeeds, the supervisor stays under 200 MB, its last line is logged."""
    (tmp_path / "hook.py").write_text(LOUD_HOOK)
    job = _job(
        tmp_path,
        {"default": "ok"},
        on_event=[sys.executable, str(tmp_path / "hook.py")],
        on_event_timeout="120s",
    )
    done = subprocess.run(
        [sys.executable, "-c", MEASURED, str(RUNNER), str(job)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rss_kb = int(done.stderr.rsplit("maxrss_kb=", 1)[1])
    assert rss_kb < 200_000, rss_kb
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    failed = [e for e in events if e["event"] == "hook_failed"]
    assert failed and "exit status 3: the webhook answered 503" in json.dumps(failed[0])
