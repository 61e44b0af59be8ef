"""What an environment's readiness counts, kept as its episodes move: ``ReadinessTally``.

A prepare asks for the readiness of the live episodes (which are inside a ``wait`` step, which are
restarts, how many are parked or inside a ``replay`` step), again each time one parks or leaves a
step, and a commit asks once more. A walk over 4,096 episodes in flight cost the environment about
3 ms of CPU each time in the scale bench, inside the pause and on the path every other participant
waits on. So the tally is kept where the episodes change instead: an episode tells it when its step's
mode is set or cleared and when it is marked a restart (``Episode.watcher``); the adapter, when an
episode starts, parks, goes on or leaves. An answer then costs the size of a few sets and a look at
the episodes inside ``wait`` steps (few: each one blocks).
"""

from __future__ import annotations

from nemo_gym_ckpt.checkpoint.adapter import Readiness
from nemo_gym_ckpt.environment.episode import Episode

__all__ = ["ReadinessTally"]


class ReadinessTally:
    """The live episodes by what readiness looks at, by capture key (the adapter's keys)."""

    def __init__(self) -> None:
        self.in_wait: dict[str, Episode] = {}
        self.in_replay: set[str] = set()
        self.restarts: dict[str, None] = {}  # in the order they were marked
        self.parked = 0

    def moved(self, key: str, episode: Episode) -> None:
        """``episode`` (live under ``key``) started, entered or left a step, or was marked a restart."""
        mode = episode.current_mode
        if mode == "wait":
            self.in_wait[key] = episode
        else:
            self.in_wait.pop(key, None)
        if mode == "replay":
            self.in_replay.add(key)
        else:
            self.in_replay.discard(key)
        if episode.restart:
            self.restarts[key] = None

    def left(self, key: str) -> None:
        """The episode live under ``key`` is gone (finished, failed or stopped)."""
        self.in_wait.pop(key, None)
        self.in_replay.discard(key)
        self.restarts.pop(key, None)

    def readiness(self, episodes: int, installed: int, *, with_lists: bool) -> Readiness:
        """Blockers (inside a ``wait`` step, not a restart) and restarts, listed with ``with_lists``;
        the counts always."""
        blockers = [key for key, episode in self.in_wait.items() if not episode.restart] if with_lists else []
        counts = {"episodes": episodes, "parked": self.parked, "in_wait_step": len(self.in_wait),
                  "in_replay_step": len(self.in_replay), "restarts": len(self.restarts), "installed": installed}
        return Readiness(blockers=blockers, counts=counts, restarts=list(self.restarts) if with_lists else [])
