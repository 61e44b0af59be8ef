"""A bounded count of slots held at once: the take past the bound is refused up front.

A server that must not let work pile up takes a ``Slot`` before it does anything for a request, and
holds it until the request is done with. While ``limit`` slots are held, the next ``take`` raises
``Overloaded`` (429 ``capacity_exceeded`` with ``Retry-After``) with the refusal its owner words:
nothing of the refused request exists anywhere, so its caller may send the very same request again
later. The environment bounds its ``/run`` calls with it (``environment/capacity.py``), the inference
worker its completions (``model_servers/inference_worker/admission.py``).

A slot is given back exactly once, however its holder ends: on leaving its ``with`` block (an error or
a cancellation included), by ``release`` (a second call gives nothing back), or by the holder it was
passed on to (``pass_on``: a streamed reply that outlives the handler that took the slot).
"""

from __future__ import annotations

from types import TracebackType

from nemo_gym_ckpt.errors import Overloaded

__all__ = ["Slot", "Slots"]


class Slots:
    """Counts the slots held; ``take`` refuses one past ``limit`` (``None``: no limit).

    ``limit_name`` is the owner's name for the bound (its config keys), ``refusal`` the detail of its
    429; ``retry_after_s`` is the refusal's ``Retry-After``.
    """

    def __init__(self, limit: int | None, retry_after_s: float, *, limit_name: str, refusal: str) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"{limit_name} must be >= 1 (or null: no limit), got {limit}")
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.refusal = refusal
        self.held = 0
        self.refused = 0

    def take(self) -> Slot:
        """One slot, given back by ``Slot.release`` (or leaving its ``with`` block); ``Overloaded``
        when ``limit`` are held."""
        if self.limit is not None and self.held >= self.limit:
            self.refused += 1
            raise Overloaded(self.refusal, retry_after_s=self.retry_after_s)
        self.held += 1
        return Slot(self)

    def _give_back(self) -> None:
        self.held -= 1


class Slot:
    """One slot of a ``Slots``; given back once, by whoever holds it last (``pass_on`` hands it over)."""

    def __init__(self, slots: Slots | None) -> None:
        self._slots = slots  # None once given back or passed on

    def release(self) -> None:
        slots, self._slots = self._slots, None
        if slots is not None:
            slots._give_back()

    def pass_on(self) -> Slot:
        """The same slot for whoever outlives this holder (a streamed reply); this one then gives
        nothing back."""
        slots, self._slots = self._slots, None
        return Slot(slots)

    def __enter__(self) -> Slot:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
