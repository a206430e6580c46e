"""Resident-set figures of this process from /proc, in bytes."""

from __future__ import annotations

import os


def proc_status(*keys: str) -> dict[str, int]:
    """Fields of /proc/self/status given in kB (VmHWM, VmRSS, RssAnon, RssFile, ...), in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for ln in f:
            k, _, v = ln.partition(":")
            if k in keys:
                out[k] = int(v.split()[0]) * 1024
    return out


def rss() -> int:
    """Resident set size now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """This process's peak resident set (VmHWM). Not getrusage's ru_maxrss: a child forked from a big parent
    (one that compiled the model) inherits the parent's high-water mark across exec."""
    return proc_status("VmHWM")["VmHWM"]
