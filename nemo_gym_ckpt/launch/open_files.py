"""How many connections a server process may hold: its open-file limit, and its client's pool.

A server of the mesh holds one socket per request it serves and one per call it makes. At 4,096
rollouts in flight an environment serves 4,096 ``/run`` calls and makes about as many calls to the
agent at once, each held for the whole activation. A client pool smaller than that queues every
other call behind them: a 1,024-connection pool kept the environment's ``/close`` and ``/verify``
calls waiting for minutes behind 3,000 activations, and a checkpoint's prepare waited with them
(docs/benchmarks.md). So each server process raises its soft open-file limit to the hard one (as
vLLM's servers do) and sizes its client's pool from what it then has, a third of it, between
``MIN_POOL`` and ``MAX_POOL``: the rest is left for the connections it serves.
"""

from __future__ import annotations

import resource

__all__ = ["MAX_POOL", "MIN_POOL", "raise_open_file_limit", "server_pool_size"]

MIN_POOL = 1024
MAX_POOL = 16_384
_WANTED_FILES = 65_536


def raise_open_file_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` toward the hard one (at most 65,536); the soft limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = _WANTED_FILES if hard == resource.RLIM_INFINITY else min(hard, _WANTED_FILES)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):
            return soft
        return wanted
    return soft


def server_pool_size(open_files: int) -> int:
    """The client pool of a server process allowed ``open_files`` files."""
    return max(MIN_POOL, min(MAX_POOL, open_files // 3))
