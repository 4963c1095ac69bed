"""gc_paused (ddtree/base/gc_pause.py): the collector off inside the block, as it was after it, errors included; and
load() leaves it as it found it."""
import gc

import pytest

from ddtree.base.gc_pause import gc_paused


@pytest.fixture
def restore_gc():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("enabled", [True, False])
def test_off_inside_and_as_before_after(restore_gc, enabled):
    (gc.enable if enabled else gc.disable)()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled() == enabled


def test_back_on_after_an_error(restore_gc):
    gc.enable()
    with pytest.raises(KeyError):
        with gc_paused():
            raise KeyError("x")
    assert gc.isenabled()


def test_load_leaves_the_collector_on(restore_gc):
    import ddtree

    gc.enable()
    pair = ddtree.load(cpu_kernel="off")
    assert gc.isenabled() and pair.target is not None
