"""The data-plane headers of the checkpoint contract (docs/protocol.md sections 7 and 11).

A resources server's ``/seed_session`` reply declares what a checkpoint may do with its work
(``VERIFY_HEADER``: ``replay`` or ``wait``; ``RESTART_HEADER: 1`` for a restart-only server, and an
agent without session checkpoints says the same); the environment numbers the calls it makes to its
agent with ``ACTIVATION_HEADER`` (1-based). An agent whose ``/close`` may run again (it is idempotent)
says so on its ``/v1/responses`` replies (``CLOSE_HEADER: replay``): the environment's close step then
replays after a crash instead of holding a checkpoint until it ends; without the header it waits.
"""

from __future__ import annotations

__all__ = ["ACTIVATION_HEADER", "CLOSE_HEADER", "RESTART_HEADER", "VERIFY_HEADER"]

VERIFY_HEADER = "x-ng-checkpoint-verify"
RESTART_HEADER = "x-ng-checkpoint-restart"
ACTIVATION_HEADER = "x-ng-agent-activation"
CLOSE_HEADER = "x-ng-checkpoint-close"
