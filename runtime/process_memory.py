"""The one reader of a process's memory (Linux /proc, the standard library only): a process tree, its
resident memory now, and a process's peak.

    rss_bytes(process_tree(pid))        # a server and the processes it started, now
    rss_bytes([os.getpid()])            # this process, now
    peak_rss_bytes()                    # this process's high-water mark (children=True: its waited-for children's)

Its readers: runtime.triton.server (the server's processes), bench.runners and bench.slots (a session's
load), bench.serve (a server's peak, sampled) and bench.scale's measuring wrapper (a child's tree, under a
memory cap), which imports this module alone, so that the wrapper stays small.
"""
from __future__ import annotations

from pathlib import Path


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (Linux /proc), parents first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def rss_bytes(pids: list[int]) -> int:
    """Resident memory of these processes together (VmRSS from /proc; gone ones count 0)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            continue
    return total


def peak_rss_bytes(children: bool = False) -> int:
    """The peak resident memory of this process (ru_maxrss), or with children=True the largest of its
    children it has waited for."""
    import resource
    who = resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF
    return resource.getrusage(who).ru_maxrss * 1024   # KiB on Linux
