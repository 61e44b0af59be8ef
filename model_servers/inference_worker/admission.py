"""How many completions the worker holds at once: one past the bound is refused up front.

The engine decodes ``max_batch_size`` sequences at a time; every other request admitted waits in
its queue (the transformers scheduler's waiting queue, vLLM's own), holding its prompt. Without a
bound they piled up without limit. A completion (``/v1/completions``, ``/v1/chat/completions``) is
held from before anything is done for it (no prompt tokenized, no staged prefix read, no
generation registered for cuts) until its reply is sent or its client went away; at most
``max_batch_size + max_waiting_requests`` are held, and the next is refused with 429
``capacity_exceeded`` and ``Retry-After``, the environment's refusal of a ``/run`` past its
capacity: nothing of it exists anywhere, so the caller sends the very same request again later (the
policy model does, within its call's deadline). The count and its slots are the library's
(``nemo_gym_ckpt/slots.py``), shared with the environment's capacity; what is worker's own is the
bound's name and the refusal's words.
"""

from __future__ import annotations

from nemo_gym_ckpt.slots import Slot, Slots

__all__ = ["DEFAULT_MAX_WAITING", "Admission"]

#: The environment's default ``max_rollouts_in_flight``: a mesh at its defaults (one model call in
#: flight per rollout) never meets this bound; it stops a pile-up, not the mesh's own load.
DEFAULT_MAX_WAITING = 4096


class Admission(Slots):
    """Counts the completions held; ``hold`` refuses one past ``limit`` (``None``: no limit)."""

    def __init__(self, limit: int | None, retry_after_s: float = 1.0) -> None:
        super().__init__(
            limit, retry_after_s, limit_name="max_batch_size + max_waiting_requests",
            refusal=f"this inference worker holds {limit} completions at once (max_batch_size + "
                    "max_waiting_requests); nothing was started: send it again later",
        )

    def hold(self) -> Slot:
        """A completion's slot, given back by ``Slot.release`` (or leaving its ``with`` block)."""
        return self.take()
