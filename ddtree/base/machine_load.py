"""What the machine is and how busy the rest of it is while we measure (Linux; elsewhere the load is unknown).

A benchmark run is only as good as the quiet around it: another process on a 2-core machine can slow a decoding
run several times over. `LoadMeter.lap()` reads how many cores OTHER processes used since the last lap (the
machine's busy time in /proc/stat, a VM's stolen time included, minus this process's own CPU time), so each run
can say how loaded the machine was while it ran.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

# /proc/stat's "cpu" line: user nice system idle iowait irq softirq steal [guest guest_nice] (guest time is
# already inside user). Busy = everything but idle and iowait; steal is time the host gave another VM.
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_busy_seconds(stat_text: str) -> float:
    """CPU-seconds the whole machine has been busy (all cores), from /proc/stat's text."""
    for line in stat_text.splitlines():
        if line.startswith("cpu "):
            ticks = [int(x) for x in line.split()[1:]]
            return sum(ticks[i] for i in _BUSY_FIELDS if i < len(ticks)) / _TICKS
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


def _read_stat() -> str | None:
    try:
        return Path("/proc/stat").read_text()
    except OSError:
        return None


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class LoadMeter:
    """lap() -> cores used by other processes (and other VMs) on average since the previous lap (or since the
    meter was made): 0.0 on a quiet machine, ~1.0 with one other busy process; None where the machine's busy time
    cannot be read. `expected` cores are subtracted (sibling processes of the same run)."""

    def __init__(self, expected: float = 0.0, read_stat: Callable[[], str | None] = _read_stat,
                 own_seconds: Callable[[], float] = _own_seconds, clock: Callable[[], float] = time.monotonic):
        self.expected, self._read, self._own, self._clock = expected, read_stat, own_seconds, clock
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float] | None:
        text = self._read()
        if text is None:
            return None
        try:
            return machine_busy_seconds(text), self._own(), self._clock()
        except ValueError:
            return None

    def lap(self) -> float | None:
        now, last = self._sample(), self._last
        self._last = now
        if now is None or last is None or now[2] <= last[2]:
            return None
        others = (now[0] - last[0]) - (now[1] - last[1])
        return max(0.0, others / (now[2] - last[2]) - self.expected)

    def lap_after(self, seconds: float) -> float | None:
        """lap(), once at least `seconds` have passed since the previous sample (sleeping the rest): a meter made
        before some work measures the machine while the work runs, and only what is left of the window is waited."""
        if self._last is not None:
            time.sleep(max(0.0, seconds - (self._clock() - self._last[2])))
        return self.lap()


def busy_cores(seconds: float = 0.5) -> float | None:
    """Cores other processes use right now, averaged over `seconds` (None where unknown)."""
    meter = LoadMeter()
    time.sleep(seconds)
    return meter.lap()


def default_threads(world: int = 1, busy: float | None = None) -> int:
    """Threads per process, leaving out the cores other processes keep busy (`busy`, busy_cores()): on an idle
    machine two threads make a plain decoding step faster than one, but threads contending with another busy
    process run many times slower (OpenMP spin-waits)."""
    return max(1, ((os.cpu_count() or 1) - round(busy or 0.0)) // world)


def cpu_description() -> str:
    """The CPU as a figure must name it: model (with its family and model numbers: a VM may hide the name),
    cores, and the vector extensions that decide its speed here, e.g.
    "AMD EPYC (family 26, model 2; 2 cores; AVX-512, VNNI, no AMX)"."""
    fields, flags = {}, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "flags" and not flags:
                flags = set(value.split())
            elif key in ("model name", "cpu family", "model") and key not in fields:
                fields[key] = value.strip()
    except OSError:
        pass
    import platform

    model = fields.get("model name") or platform.processor() or platform.machine()
    details = [f"family {fields['cpu family']}, model {fields['model']}"] if "cpu family" in fields else []
    details.append(f"{os.cpu_count()} cores")
    if flags:
        details.append(", ".join(["AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2",
                                  "VNNI" if {"avx512_vnni", "avx_vnni"} & flags else "no VNNI",
                                  "AMX" if "amx_int8" in flags else "no AMX"]))
    return f"{model} ({'; '.join(details)})"
