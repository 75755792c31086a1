"""What the bench and chaos scripts report about this host and its
processes, from /proc."""


def cpu_model():
    """The CPU's model name, or "unknown"."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def rss_mib(pid):
    """The resident set of process `pid` in MiB, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None
