"""Checkpoint telemetry (docs/protocol.md section 9) on the OpenTelemetry API.

Spans ``gym.checkpoint.<op>`` per participant operation (renew excepted, as upstream: a renew is
neither spanned nor timed, only its refusals are counted), with children ``wait_ready``, ``export``,
``write``, ``read``, ``install`` and ``generation_cut`` (the policy model's cut request to its
worker during a commit, generation cuts on; ``records`` = the durable cuts kept);
``gym.checkpoint.coordinate.<op>`` in the coordinator. Attributes
``nemo.gym.checkpoint.{id, participant_kind, instance, records, bytes, phase}``.
Metrics: ``gym.checkpoint.operation.duration`` (ms, by operation, kind and outcome: ``ok`` or
``error``, as upstream labels it; the code of a refusal is on its ``refused`` event),
``gym.checkpoint.records``, ``gym.checkpoint.bytes``, and ``gym.checkpoint.events`` (``refused``
with its code, ``lease_expired``, ``prepare_not_ready``, and ``generation_cut_failed`` with its code:
a cut request that failed or ran late, so that commit went on without cuts). Providers are passed
in (tests give SDK ones with in-memory exporters); by default the global API is used, which costs
nothing until an SDK is configured (``checkpoint.otlp``, from the config's ``telemetry:`` block).
Spans on the global API are upstream's opt-in span group ``checkpoint``: until
``open_span_groups`` names it, a ``Telemetry`` without a tracer provider of its own traces nothing
(its metrics still go to the global meter provider).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import metrics, trace

from nemo_gym_ckpt.errors import GymError

__all__ = ["ATTR", "CHECKPOINT_SPAN_GROUP", "METRIC", "Telemetry", "open_span_groups"]

SCOPE = "nemo_gym_ckpt.checkpoint"
PREFIX = "nemo.gym.checkpoint."
CHECKPOINT_SPAN_GROUP = "checkpoint"
_OPEN_SPAN_GROUPS: set[str] = set()


def open_span_groups(groups: Iterable[str]) -> None:
    """The span groups this process traces on the global API (the config's ``span_groups``)."""
    _OPEN_SPAN_GROUPS.clear()
    _OPEN_SPAN_GROUPS.update(groups)


def _tracer_of(tracer_provider: Any) -> trace.Tracer:
    if tracer_provider is None and CHECKPOINT_SPAN_GROUP not in _OPEN_SPAN_GROUPS:
        return trace.NoOpTracer()
    return trace.get_tracer(SCOPE, tracer_provider=tracer_provider)


class ATTR:
    ID = PREFIX + "id"
    KIND = PREFIX + "participant_kind"
    INSTANCE = PREFIX + "instance"
    RECORDS = PREFIX + "records"
    BYTES = PREFIX + "bytes"
    PHASE = PREFIX + "phase"
    OPERATION = PREFIX + "operation"
    OUTCOME = PREFIX + "outcome"
    EVENT = PREFIX + "event"
    CODE = PREFIX + "code"


class METRIC:
    DURATION = "gym.checkpoint.operation.duration"
    RECORDS = "gym.checkpoint.records"
    BYTES = "gym.checkpoint.bytes"
    EVENTS = "gym.checkpoint.events"


class Telemetry:
    """Spans and instruments of one participant (or coordinator), labelled by kind and instance."""

    def __init__(self, kind: str, instance: str, *, tracer_provider: Any = None, meter_provider: Any = None):
        self.kind = kind
        self.instance = instance
        self.tracer = _tracer_of(tracer_provider)
        meter = metrics.get_meter(SCOPE, meter_provider=meter_provider)
        self._duration = meter.create_histogram(METRIC.DURATION, unit="ms")
        self._records = meter.create_counter(METRIC.RECORDS)
        self._bytes = meter.create_counter(METRIC.BYTES, unit="By")
        self._events = meter.create_counter(METRIC.EVENTS)

    def for_participant(self, kind: str, instance: str) -> Telemetry:
        """The same providers, labelled for another participant."""
        other = object.__new__(Telemetry)
        other.__dict__.update(self.__dict__, kind=kind, instance=instance)
        return other

    @contextmanager
    def operation(self, name: str, checkpoint_id: str | None) -> Iterator[trace.Span]:
        """A ``gym.checkpoint.<name>`` span, timed; a ``GymError`` counts as ``refused``."""
        started, outcome = time.perf_counter(), "error"
        with self.span(name, **{ATTR.ID: checkpoint_id}) as span:
            try:
                yield span
                outcome = "ok"
            except GymError as error:
                self.event("refused", code=error.code)
                raise
            finally:
                elapsed_ms = (time.perf_counter() - started) * 1000
                self._duration.record(elapsed_ms, {ATTR.OPERATION: name, ATTR.KIND: self.kind,
                                                   ATTR.OUTCOME: outcome})

    @contextmanager
    def refusals(self) -> Iterator[None]:
        """An untraced operation (renew): a ``GymError`` still counts as ``refused``."""
        try:
            yield
        except GymError as error:
            self.event("refused", code=error.code)
            raise

    @contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[trace.Span]:
        """A ``gym.checkpoint.<name>`` span with the kind and instance attributes."""
        attrs = {ATTR.KIND: self.kind, ATTR.INSTANCE: self.instance}
        attrs.update({key: value for key, value in attributes.items() if value is not None})
        with self.tracer.start_as_current_span(f"gym.checkpoint.{name}", attributes=attrs) as span:
            yield span

    def moved(self, operation: str, span: trace.Span, records: int, size: int) -> None:
        """Records and bytes written or read by ``operation``."""
        span.set_attributes({ATTR.RECORDS: records, ATTR.BYTES: size})
        labels = {ATTR.OPERATION: operation, ATTR.KIND: self.kind}
        self._records.add(records, labels)
        self._bytes.add(size, labels)

    def event(self, name: str, *, code: str | None = None) -> None:
        labels = {ATTR.EVENT: name, ATTR.KIND: self.kind}
        if code is not None:
            labels[ATTR.CODE] = code
        self._events.add(1, labels)
