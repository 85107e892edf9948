"""In-job recovery's pieces in one process: freeing the broken groups (a gloo group closes its
connections only when it is freed), and a carried checkpointer's restore not waiting for the old
group's save in flight."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
import torch.distributed as dist

from resilient import Checkpointer
from resilient.checkpoint.checkpointer import SaveHandle
from resilient.loop import _free_process_groups

HELD: list = []


@pytest.fixture
def group():
    """A real gloo world of one, and a subgroup of it; gc's frozen set restored afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    box = [dist.new_group([0])]  # the test takes it: this frame must not hold it
    yield box
    HELD.clear()
    gc.unfreeze()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_group_nothing_holds_is_freed_by_the_collection(group):
    holder: dict = {"pg": group.pop()}
    holder["self"] = holder  # a cycle: only a collection frees it
    del holder
    assert _free_process_groups() == "collected"
    assert not dist.is_initialized()


def test_a_group_held_by_a_frozen_cycle_needs_the_full_collection(group):
    holder: dict = {"pg": group.pop()}
    holder["self"] = holder
    del holder
    gc.freeze()  # as the trainer freezes what its start-up built
    assert _free_process_groups() == "all"
    assert gc.get_freeze_count() > 0  # what survived is frozen again


def test_a_group_still_referenced_is_reported_held(group):
    HELD.append(group.pop())  # a module-level cache: nothing can free it
    assert _free_process_groups() == "held"


def test_a_carried_checkpointers_restore_does_not_wait_for_the_old_groups_save(tmp_path):
    """After rebind (in-job recovery), load() restores without joining the previous group's
    durable save in flight (rank 0 may be waiting on its persister); the next save joins it,
    and that old save's commit does not move the restored state's anchor."""
    state = {"w": torch.arange(4.0)}
    ck = Checkpointer(str(tmp_path / "ck"))
    ck.save(1, state).wait()
    # the old group's save of step 2, still running (its thread waits to be released)
    release = threading.Event()
    old = SaveHandle(2, ck._lineage)

    def in_flight() -> None:
        release.wait(60)
        old._finish(None)

    thread = threading.Thread(target=in_flight, daemon=True)
    thread.start()
    ck._pending, ck._thread = old, thread
    ck.rebind()
    restored = {"w": torch.zeros(4)}
    assert ck.load(restored) == 1  # returned with the old save still in flight
    assert thread.is_alive() and torch.equal(restored["w"], state["w"])
    anchor = ck._anchor
    ck._advance_anchor(old, 2, 99)  # the old save commits now: the restore's anchor stands
    assert ck._anchor == anchor
    release.set()
    ck.save(3, state).wait()  # joins the old save first
    assert not thread.is_alive() and ck.latest_step() == 3
    ck.close()
