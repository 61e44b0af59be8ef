"""No automatic cyclic garbage collection in a process while one of its checkpoints is open.

A full collection walks every object the collector tracks. With 4,096 rollouts in flight a server's
heap is hundreds of MB, and one full collection held its event loop for 2-4 s (docs/benchmarks.md,
scale): a prepare or a commit that arrived meanwhile waited that long, and a checkpoint asks four
servers in a row. So while any participant of the process has a checkpoint open (from its prepare
or restore to its resume or the lease's expiry, so never longer than a lease) automatic collection
is off. Reference counting still frees everything outside a cycle; the cycles made meanwhile are
found by the first collection after the resume. A process whose collection was already off keeps
it off.

It acts only in a process that asked for it (``pause_collection_during_checkpoints``): a server
process does (``nemo_gym_ckpt.cli.serve``); a test process that builds participants in process does
not, so a checkpoint a test leaves open never leaves its collector off.
"""

from __future__ import annotations

import gc
import threading

__all__ = ["CollectionHold", "pause_collection_during_checkpoints"]

_lock = threading.Lock()
_active = False
_holders = 0
_reenable = False


def pause_collection_during_checkpoints(active: bool = True) -> None:
    """Let (or stop letting) this process's holds turn automatic collection off."""
    global _active
    with _lock:
        _active = active


class CollectionHold:
    """One participant's hold: ``hold`` and ``release`` are idempotent; the last release of the
    process turns collection back on (if a hold turned it off)."""

    def __init__(self) -> None:
        self.held = False

    def hold(self) -> None:
        global _holders, _reenable
        with _lock:
            if self.held or not _active:
                return
            self.held = True
            _holders += 1
            if _holders == 1:
                _reenable = gc.isenabled()
                gc.disable()

    def release(self) -> None:
        global _holders, _reenable
        with _lock:
            if not self.held:
                return
            self.held = False
            _holders -= 1
            if _holders == 0 and _reenable:
                _reenable = False
                gc.enable()
