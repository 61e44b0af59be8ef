"""How many completions the worker holds at once: one past the bound is refused up front.

The engine decodes ``max_batch_size`` sequences at a time; every other request admitted waits in
its queue (the transformers scheduler's waiting queue, vLLM's own), holding its prompt. Without a
bound they piled up without limit. A completion (``/v1/completions``, ``/v1/chat/completions``) is
held from before anything is done for it (no prompt tokenized, no staged prefix read, no
generation registered for cuts) until its reply is sent or its client went away; at most
``max_batch_size + max_waiting_requests`` are held, and the next is refused with 429
``capacity_exceeded`` and ``Retry-After``, the environment's refusal of a ``/run`` past its
capacity (``nemo_gym_ckpt/environment/capacity.py``): nothing of it exists anywhere, so the caller
sends the very same request again later (the policy model does, within its call's deadline).
"""

from __future__ import annotations

from types import TracebackType

from nemo_gym_ckpt.errors import Overloaded

__all__ = ["DEFAULT_MAX_WAITING", "Admission", "Held"]

#: The environment's default ``max_rollouts_in_flight``: a mesh at its defaults (one model call in
#: flight per rollout) never meets this bound; it stops a pile-up, not the mesh's own load.
DEFAULT_MAX_WAITING = 4096


class Admission:
    """Counts the completions held; ``hold`` refuses one past ``limit`` (``None``: no limit)."""

    def __init__(self, limit: int | None, retry_after_s: float = 1.0) -> None:
        if limit is not None and limit < 1:
            raise ValueError("an admission limit must be >= 1 (or None: no limit)")
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.held = 0
        self.refused = 0

    def hold(self) -> Held:
        """A hold on one place, released by ``Held.release`` (or leaving its ``with`` block)."""
        if self.limit is not None and self.held >= self.limit:
            self.refused += 1
            raise Overloaded(f"this inference worker holds {self.limit} completions at once (max_batch_size + "
                             "max_waiting_requests); nothing was started: send it again later",
                             retry_after_s=self.retry_after_s)
        self.held += 1
        return Held(self)

    def _release(self) -> None:
        self.held -= 1


class Held:
    """One completion's place; released once, by whoever holds it last (``pass_on`` hands it over)."""

    def __init__(self, admission: Admission | None) -> None:
        self._admission = admission  # None once released or passed on

    def release(self) -> None:
        admission, self._admission = self._admission, None
        if admission is not None:
            admission._release()

    def pass_on(self) -> Held:
        """A hold on the same place for whoever outlives this block (a streamed reply); this one
        then releases nothing."""
        admission, self._admission = self._admission, None
        return Held(admission)

    def __enter__(self) -> Held:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
