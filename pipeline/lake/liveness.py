"""Is a lease holder provably dead? On Linux a process is named by (host, boot id,
pid namespace, pid, pid start time): a reader on the same host, boot and pid
namespace can tell for certain whether that process still runs, with no
timeout. Anywhere else (another host, no /proc) nothing is provable and a
lease only ends by expiry."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any


def identity() -> dict[str, Any]:
    """What tells, on Linux, that a lease holder is a process of *this* machine and
    pid namespace (boot id + pid-namespace inode) and which incarnation of its pid
    it is (start time in clock ticks): enough to prove a same-host holder dead.
    Empty where /proc does not say (the lease then only ends by expiry)."""
    out: dict[str, Any] = {}
    try:
        out["boot_id"] = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        out["pidns"] = os.readlink("/proc/self/ns/pid")
        out["pid_start"] = pid_start(os.getpid())
    except OSError:
        return {}
    return out


def pid_start(pid: int) -> int | None:
    """The start time of running process ``pid`` (None when there is none, or only its zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])   # a zombie has exited; field 22: starttime


def holder_is_dead(held: dict[str, Any]) -> bool:
    """True only when a holder that declared its lease bound to its process
    (``pid_bound``) provably no longer runs: same host, boot and pid namespace as
    this process, and its pid is gone or belongs to a newer process. Leases not
    so declared end by expiry or release only."""
    if not held.get("pid_bound") or not held.get("pid") or held.get("host") != socket.gethostname() \
            or "pid_start" not in held:
        return False
    me = identity()
    if not me or me["boot_id"] != held.get("boot_id") or me["pidns"] != held.get("pidns"):
        return False
    return pid_start(int(held["pid"])) != held["pid_start"]
