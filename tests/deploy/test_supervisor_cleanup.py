"""The supervisor's own clean-up, on a real supervisor process whose one
child sleeps (no model): its run dir is 0700 and holds the arena's name while
it runs, and is gone after SIGTERM or a closed terminal (SIGHUP); after a
SIGKILL of the supervisor it is left, and the next start sweeps it."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from deploy.run_dir import ARENAS, LOCK, sweep_leftovers

REPO = Path(__file__).resolve().parents[2]

SUPERVISOR = textwrap.dedent("""
    import signal, sys
    from environment.settings import Settings
    from deploy.supervisor import Child, Supervisor

    class OneSleeper(Supervisor):
        def _plan(self):
            self.children.append(Child("cache", "time:sleep", lambda: (120,)))

    # As in a terminal: the test may run under nohup, whose ignored SIGHUP
    # the supervisor (rightly) leaves alone.
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    supervisor = OneSleeper(Settings(model_id="m", port=0, drain_timeout_s=1.0))  # any free port: it binds it
    signal.signal(signal.SIGTERM, supervisor.request_stop)
    sys.exit(supervisor.run())
""")


def _start(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR], cwd=REPO, env=env, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        # Written, not just made: the arena's name is one write after the file's creation.
        found = [p for p in tmp_path.glob(f"tandem-{proc.pid}-*") if (p / ARENAS).exists()
                 and (p / ARENAS).stat().st_size]
        if found:
            return proc, found[0]
        assert proc.poll() is None, f"the supervisor exited with {proc.returncode}"
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("no run dir appeared")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_the_run_dir_is_private_while_serving_and_gone_after_a_signal(tmp_path, sig):
    proc, run_dir = _start(tmp_path)
    try:
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
        assert (run_dir / LOCK).exists()
        assert (run_dir / ARENAS).read_text().startswith(f"tandem-{proc.pid}-")
        proc.send_signal(sig)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert list(tmp_path.iterdir()) == []


def test_a_killed_supervisors_run_dir_is_swept_by_the_next_start(tmp_path):
    proc, run_dir = _start(tmp_path)
    os.killpg(proc.pid, signal.SIGKILL)  # the supervisor; its child is in its own group and sees it go
    proc.wait(10)
    assert run_dir.is_dir()
    # Swept once no live process holds its lock: the supervisor's child exits
    # when it sees its parent gone (at once on a quiet box; later on a busy one).
    removed, deadline = [], time.monotonic() + 20
    while str(run_dir) not in removed and time.monotonic() < deadline:
        removed += sweep_leftovers(str(tmp_path))
        time.sleep(0.1)
    assert str(run_dir) in removed
    assert list(tmp_path.iterdir()) == []
