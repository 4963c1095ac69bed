"""The machine's load as the benchmark reads it: other processes' CPU time from /proc/stat minus our own."""
import pytest

from ddtree.base import machine_load
from ddtree.base.machine_load import LoadMeter, cpu_description, machine_busy_seconds

TICKS = machine_load._TICKS


def stat(user, system, idle, steal=0, iowait=0):
    return (f"cpu  {user} 0 {system} {idle} {iowait} 0 0 {steal} 0 0\n"
            f"cpu0 {user} 0 {system} {idle} {iowait} 0 0 {steal} 0 0\nintr 1 2 3\n")


def test_busy_seconds_count_everything_but_idle_and_iowait():
    assert machine_busy_seconds(stat(100, 50, 1000, steal=30, iowait=70)) == pytest.approx(180 / TICKS)
    with pytest.raises(ValueError, match="no aggregate"):
        machine_busy_seconds("intr 1\n")


class Machine:
    """A fake machine: busy ticks, this process's CPU seconds and the clock, advanced by the test."""

    def __init__(self):
        self.busy, self.own, self.now = 0, 0.0, 0.0

    def meter(self, expected=0.0):
        return LoadMeter(expected, read_stat=lambda: stat(self.busy, 0, 10**6), own_seconds=lambda: self.own,
                         clock=lambda: self.now)

    def run(self, seconds, own_cores, other_cores):
        self.now += seconds
        self.own += seconds * own_cores
        self.busy += round(seconds * (own_cores + other_cores) * TICKS)


def test_a_lap_is_the_cores_other_processes_used():
    m = Machine()
    meter = m.meter()
    m.run(2.0, own_cores=2.0, other_cores=0.0)  # we used both cores: quiet
    assert meter.lap() == pytest.approx(0.0, abs=0.01)
    m.run(1.0, own_cores=1.0, other_cores=1.0)  # another process on one core
    assert meter.lap() == pytest.approx(1.0, abs=0.01)
    m.run(4.0, own_cores=1.0, other_cores=0.5)  # half a core on average since the last lap
    assert meter.lap() == pytest.approx(0.5, abs=0.01)
    sibling = m.meter(expected=1.0)  # a sibling rank's core is expected, not noise
    m.run(1.0, own_cores=1.0, other_cores=1.0)
    assert sibling.lap() == pytest.approx(0.0, abs=0.01)


def test_lap_after_waits_only_what_is_left_of_the_window(monkeypatch):
    """A meter made before a load's work measures during it: lap_after(0.5) sleeps the rest of the 0.5 s, none
    after a longer stretch of work, and reads what other processes used over the whole of it."""
    m, slept = Machine(), []
    monkeypatch.setattr(machine_load.time, "sleep", lambda s: (slept.append(s), m.run(s, 0.0, 1.0)))
    meter = m.meter()
    m.run(0.2, own_cores=1.0, other_cores=1.0)  # the load's first 0.2 s, beside a busy process
    assert meter.lap_after(0.5) == pytest.approx(1.0, abs=0.01) and slept == [pytest.approx(0.3)]
    m.run(1.5, own_cores=2.0, other_cores=0.0)
    assert meter.lap_after(0.5) == pytest.approx(0.0, abs=0.01) and slept[-1] == 0.0
    unknown = LoadMeter(read_stat=lambda: None)
    assert unknown.lap_after(0.5) is None and len(slept) == 2  # nothing to wait for


def test_the_load_is_unknown_where_proc_stat_cannot_be_read():
    meter = LoadMeter(read_stat=lambda: None)
    assert meter.lap() is None
    assert LoadMeter(read_stat=lambda: "garbage\n").lap() is None


def test_this_machine_is_named_with_its_cores_and_vector_extensions():
    text = cpu_description()
    assert "cores" in text
    if "flags" in open("/proc/cpuinfo").read():
        assert "AMX" in text and "VNNI" in text  # "AMX" or "no AMX": said either way
