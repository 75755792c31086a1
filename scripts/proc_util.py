"""Stopping the processes a bench or chaos script started."""

import signal
import subprocess


def stop_processes(procs, grace_s=15):
    """SIGTERM (after SIGCONT, for a stopped one) to each process still
    running; SIGKILL to any that has not exited grace_s seconds later."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
