"""The capture ledger: per capture key, one row per call whose reply was delivered.

A row holds the coordinates and digests of a call, never its token arrays (those travel to the
caller in the reply). Fields, in this order on the wire (``ROW_FIELDS``):

| field | meaning |
|---|---|
| ``call_id`` | the model call id, given at admission (``mc_<hex>``) |
| ``parent_call_id`` | the previous delivered call of the rollout's lineage; ``null`` for the first |
| ``attempt`` | the attempt that made the call |
| ``prompt_length`` / ``output_length`` | token counts of the prompt and of the generation |
| ``prompt_digest`` / ``output_digest`` | ``ids.sha256_of`` the prompt and generated token ids |
| ``finish_reason`` | ``stop``, ``length`` or ``tool_calls`` |
| ``policy_version`` | the engine's policy version for the call |
| ``admitted_at`` | Unix seconds when the call was admitted |
| ``conversation_digest`` | ``active_calls.conversation_digest``: messages (no token fields), tools, tool choice |
| ``token_digest`` | SHA-256 of the call's line in the token sidecar; ``null`` when its reply carried no token ids |

Token arrays stay out of the rows and the records. A ledger keeps, in memory, the ``CallTokens`` of
each of its calls that delivered token ids, and a commit writes them to the token sidecar
(``token_sidecar``), which a row names only by ``token_digest``. A restored ledger gets them back
from the sidecar (checked against the row's digests), so that its rollout's next attempt can have
them: ``restored_prefixes`` (the ids a continued call's prompt is spliced from, instead of
re-tokenizing text) and ``calls`` (what ``GET /v1/capture/tokens`` answers the caller).

A rollout's ledger is one lineage across attempts: restoring attempt N installs a ledger for N+1
that inherits N's rows, and the first call N+1 delivers has N's last row as its parent. The record
of a ledger is ``{"episode_id": {rollout_id, attempt}, "ledger": [row, ...]}`` with the whole
lineage; a restored ledger that delivered nothing since is exported as the very record it came
from (byte for byte).

With generation cuts, a record may add ``"cut": {...}`` (``cuts.CutRecord``: the call in flight at
the commit, its staging keys, counts and digests, and its lineage, which must be the ledger's head
and length). An episode whose first call was cut has a record with an empty ledger. A restored cut
stays with the ledger (and in its records) until the rollout delivers its next call.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from model_servers.policy_model.active_calls import Ticket
from model_servers.policy_model.capture_memory import CaptureMemory
from model_servers.policy_model.cuts import CutRecord, Lineage
from model_servers.policy_model.generation import ChatResult
from model_servers.policy_model.token_sidecar import TOKEN_DIGEST, CallTokens, TokenedRecord
from nemo_gym_ckpt.checkpoint.adapter import ExportItem
from nemo_gym_ckpt.checkpoint.records import Record, Scope
from nemo_gym_ckpt.errors import InvalidCheckpointState
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = ["CUT_KEY", "RECORD_KEYS", "ROW_FIELDS", "Ledger", "LedgerBook", "LedgerRow", "ledger_record",
           "restored_ledger"]

RECORD_KEYS = frozenset({"episode_id", "ledger"})
CUT_KEY = "cut"
FINISH_REASONS = frozenset({"stop", "length", "tool_calls"})
_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class LedgerRow:
    call_id: str
    parent_call_id: str | None
    attempt: int
    prompt_length: int
    prompt_digest: str
    output_length: int
    output_digest: str
    finish_reason: str
    policy_version: int | str | None
    admitted_at: float
    conversation_digest: str
    token_digest: str | None = None

    @classmethod
    def delivered(
        cls, ticket: Ticket, result: ChatResult, parent_call_id: str | None, tokens: CallTokens | None = None
    ) -> LedgerRow:
        return cls(
            call_id=ticket.model_call_id,
            parent_call_id=parent_call_id,
            attempt=ticket.episode.attempt,
            prompt_length=result.prompt_tokens,
            prompt_digest=result.prompt_digest,
            output_length=result.completion_tokens,
            output_digest=result.output_digest,
            finish_reason=result.finish_reason,
            policy_version=result.policy_version,
            admitted_at=ticket.admitted_at,
            conversation_digest=ticket.conversation_digest,
            token_digest=tokens.digest if tokens is not None else None,
        )

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in ROW_FIELDS}

    @classmethod
    def from_json(cls, data: Any) -> LedgerRow:
        """A row read back from a record; anything malformed is ``InvalidCheckpointState``."""
        if not isinstance(data, dict) or set(data) != set(ROW_FIELDS):
            raise InvalidCheckpointState(f"a ledger row must have exactly the fields {list(ROW_FIELDS)}")
        for name, valid in _VALID.items():
            if not valid(data[name]):
                raise InvalidCheckpointState(f"ledger row field {name} has an invalid value {data[name]!r}")
        return cls(**data)


ROW_FIELDS = tuple(f.name for f in fields(LedgerRow))


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _digest(value: Any) -> bool:
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None


def _call_id(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 200


_VALID: dict[str, Callable[[Any], bool]] = {
    "call_id": _call_id,
    "parent_call_id": lambda value: value is None or _call_id(value),
    "attempt": _count,
    "prompt_length": _count,
    "prompt_digest": _digest,
    "output_length": _count,
    "output_digest": _digest,
    "finish_reason": lambda value: value in FINISH_REASONS,
    "policy_version": lambda value: value is None or type(value) in (int, str),
    "admitted_at": lambda value: type(value) in (int, float) and math.isfinite(value),
    "conversation_digest": _digest,
    TOKEN_DIGEST: lambda value: value is None or _digest(value),
}


@dataclass
class Ledger:
    """The delivered calls of one capture key, after the rows inherited from earlier attempts."""

    episode: RolloutIdentity
    inherited: tuple[LedgerRow, ...] = ()
    rows: list[LedgerRow] = field(default_factory=list)
    source: Record | None = None  # the record it was restored from
    restored_cut: CutRecord | None = None  # a cut to continue, until the next delivered call
    tokens: dict[str, CallTokens] = field(default_factory=dict)  # by call id: calls that delivered ids
    _encoded: tuple[int, CutRecord | None, Record] | None = field(default=None, repr=False)

    @property
    def head(self) -> str | None:
        """The call id a new row takes as its parent."""
        last = self.rows[-1] if self.rows else (self.inherited[-1] if self.inherited else None)
        return last.call_id if last else None

    @property
    def unchanged_restore(self) -> bool:
        return self.source is not None and not self.rows

    def __len__(self) -> int:
        return len(self.inherited) + len(self.rows)

    @property
    def lineage(self) -> Lineage:
        return self.head, len(self)

    def token_lines(self) -> list[CallTokens]:
        """The sidecar lines of this ledger's calls, in lineage order (restored ones as read)."""
        return [self.tokens[row.call_id] for row in (*self.inherited, *self.rows) if row.token_digest]

    def restored_prefixes(self) -> list[list[int]]:
        """Prompt + generation ids of the calls of earlier attempts that delivered ids, latest first."""
        return [self.tokens[row.call_id].prefix for row in reversed(self.inherited) if row.token_digest]

    def calls(self) -> list[dict[str, Any]]:
        """Each call of the lineage with its token fields when it delivered ids (the capture route)."""
        answer = []
        for row in (*self.inherited, *self.rows):
            tokens = self.tokens.get(row.call_id) if row.token_digest else None
            call = {"call_id": row.call_id, "attempt": row.attempt, "policy_version": row.policy_version}
            answer.append({**call, **(tokens.to_fields() if tokens is not None else {})})
        return answer

    def covered_by(self, scope: Scope | None) -> bool:
        """In ``scope`` as itself, or (restored and unchanged) as the episode it came from."""
        if scope is None or self.episode in scope:
            return True
        return self.source is not None and self.unchanged_restore and self.source.episode in scope

    def export(self, scope: Scope | None, cut: CutRecord | None = None) -> ExportItem | None:
        """The record (a fresh ``cut`` made at this commit replaces a restored one)."""
        source = self.source if self.unchanged_restore and cut is None else None
        if source is not None and (scope is None or source.episode in scope):
            return source
        if scope is not None and self.episode not in scope:
            return None
        return self._encoded_record(cut or self.restored_cut)

    def _encoded_record(self, cut: CutRecord | None) -> Record:
        """The record, built once per state (rows delivered, cut): a ledger that did not move since
        the last commit costs a lookup, and its bytes are that commit's."""
        encoded = self._encoded
        if encoded is None or encoded[0] != len(self.rows) or encoded[1] is not cut:
            record = Record.from_data(ledger_record(self.episode, (*self.inherited, *self.rows), cut))
            encoded = self._encoded = (len(self.rows), cut, record)
        return encoded[2]


def ledger_record(
    episode: RolloutIdentity, rows: Iterable[LedgerRow], cut: CutRecord | None
) -> dict[str, Any]:
    record: dict[str, Any] = {"episode_id": episode.to_json(), "ledger": [row.to_json() for row in rows]}
    if cut is not None:
        record[CUT_KEY] = cut.to_json()
    return record


class LedgerBook:
    """Every ledger of this server, by capture key; ``memory`` bounds the token lines held in memory."""

    def __init__(self, memory: CaptureMemory | None = None) -> None:
        self._ledgers: dict[str, Ledger] = {}
        self.memory = memory

    def __len__(self) -> int:
        return len(self._ledgers)

    @property
    def row_count(self) -> int:
        return sum(len(ledger) for ledger in self._ledgers.values())

    def get(self, episode: RolloutIdentity) -> Ledger | None:
        return self._ledgers.get(episode.capture_key)

    def lineage(self, episode: RolloutIdentity) -> Lineage:
        """(parent call id, previous length) a new call of ``episode`` gets."""
        ledger = self.get(episode)
        return ledger.lineage if ledger is not None else (None, 0)

    def restored_cut(self, episode: RolloutIdentity, conversation_digest: str) -> CutRecord | None:
        """The restored cut a call of ``episode`` continues, if it says what the cut call said."""
        ledger = self.get(episode)
        cut = ledger.restored_cut if ledger is not None else None
        return cut if cut is not None and cut.conversation_digest == conversation_digest else None

    def deliver(self, ticket: Ticket, result: ChatResult) -> LedgerRow:
        """Record a call whose reply is being delivered, as the new head of its lineage."""
        ledger = self._ledgers.get(ticket.episode.capture_key)
        if ledger is None:
            ledger = self._ledgers[ticket.episode.capture_key] = Ledger(ticket.episode)
        capture = result.capture
        tokens = CallTokens.of(ticket.model_call_id, capture, self.memory) if capture is not None else None
        row = LedgerRow.delivered(ticket, result, ledger.head, tokens)
        ledger.rows.append(row)
        if tokens is not None:
            ledger.tokens[row.call_id] = tokens
        ledger.restored_cut = None
        return row

    def records(
        self, scope: Scope | None, cuts: Mapping[RolloutIdentity, CutRecord] | None = None
    ) -> list[ExportItem]:
        """A snapshot of the records of the ledgers in ``scope`` (``None``: all), with this commit's
        ``cuts`` (an episode cut before its first delivered call gets a record of its own)."""
        return self.export(scope, cuts)[0]

    def export(
        self, scope: Scope | None, cuts: Mapping[RolloutIdentity, CutRecord] | None = None
    ) -> tuple[list[ExportItem], list[CallTokens]]:
        """``records``, and the sidecar lines they name (each line once), in one pass over the ledgers."""
        cuts = cuts or {}
        items: list[ExportItem] = []
        lines: dict[str, CallTokens] = {}
        for ledger in self._ledgers.values():
            item = ledger.export(scope, cuts.get(ledger.episode))
            if item is None:
                continue
            items.append(item)
            if ledger.tokens:
                for tokens in ledger.token_lines():
                    lines.setdefault(tokens.digest, tokens)
        for episode, cut in cuts.items():
            if episode.capture_key not in self._ledgers and (scope is None or episode in scope):
                items.append(ledger_record(episode, (), cut))
        return items, list(lines.values())

    def restored_prefixes(self, episode: RolloutIdentity) -> list[list[int]]:
        ledger = self.get(episode)
        return ledger.restored_prefixes() if ledger is not None else []

    def calls(self, episode: RolloutIdentity) -> list[dict[str, Any]]:
        ledger = self.get(episode)
        return ledger.calls() if ledger is not None else []

    def drop_restored_outside(self, scope: Scope | None) -> None:
        """After a commit: a restored, unchanged ledger that ``scope`` left out is deleted."""
        self._drop(lambda ledger: ledger.unchanged_restore and not ledger.covered_by(scope))

    def install(self, records: Sequence[Record]) -> list[RolloutIdentity]:
        """All or nothing: check every record, then install each under the next attempt."""
        restored = [restored_ledger(record) for record in records]
        keys = [ledger.episode.capture_key for ledger in restored]
        clashes = sorted(set(keys) & set(self._ledgers)) or sorted({k for k in keys if keys.count(k) > 1})
        if clashes:
            raise InvalidCheckpointState(f"ledgers already present or restored twice: {clashes[:10]}")
        for ledger in restored:
            self._ledgers[ledger.episode.capture_key] = ledger
        return [ledger.episode for ledger in restored]

    def retire(self, episodes: Iterable[RolloutIdentity]) -> None:
        """Cumulative: each episode's ledger and those of every earlier attempt of its rollout."""
        marks: dict[str, int] = {}
        for episode in episodes:
            marks[episode.rollout_id] = max(episode.attempt, marks.get(episode.rollout_id, -1))
        self._drop(lambda ledger: ledger.episode.attempt <= marks.get(ledger.episode.rollout_id, -1))

    def forget(self, rollout_ids: Iterable[str]) -> None:
        gone = set(rollout_ids)
        self._drop(lambda ledger: ledger.episode.rollout_id in gone)

    def _drop(self, doomed: Callable[[Ledger], bool]) -> None:
        for key in [key for key, ledger in self._ledgers.items() if doomed(ledger)]:
            for tokens in self._ledgers.pop(key).tokens.values():
                tokens.forget()


def restored_ledger(record: Record) -> Ledger:
    """The ledger of the attempt after ``record``'s, inheriting its rows and its cut (checked)."""
    keys, key = set(record.data), record.episode.capture_key
    if keys not in (RECORD_KEYS, RECORD_KEYS | {CUT_KEY}) or not isinstance(record.data["ledger"], list):
        raise InvalidCheckpointState(f"record of {key} is not a ledger record")
    rows = tuple(LedgerRow.from_json(row) for row in record.data["ledger"])
    _check_lineage(rows, record.episode)
    ledger = Ledger(record.episode.next_attempt(), rows, source=record, tokens=_restored_tokens(record, rows))
    if CUT_KEY in keys:
        cut = CutRecord.from_json(record.data[CUT_KEY], f"record of {key}")
        if cut.lineage != ledger.lineage:
            raise InvalidCheckpointState(f"record of {key}: the cut's lineage {cut.lineage} is not the "
                                         f"ledger's {ledger.lineage}")
        ledger.restored_cut = cut
    return ledger


def _restored_tokens(record: Record, rows: Sequence[LedgerRow]) -> dict[str, CallTokens]:
    """The sidecar's tokens of the rows that name them, each checked against its row."""
    found = record.tokens if isinstance(record, TokenedRecord) else {}
    tokens: dict[str, CallTokens] = {}
    for row in rows:
        if row.token_digest is None:
            continue
        where = f"ledger of {record.episode.capture_key}, call {row.call_id}"
        line = found.get(row.call_id)
        if line is None or line.digest != row.token_digest:
            raise InvalidCheckpointState(f"{where}: its token arrays are not in the token sidecar")
        line.check(row.call_id, row.prompt_digest, row.output_digest, where)
        tokens[row.call_id] = line
    return tokens


def _check_lineage(rows: Sequence[LedgerRow], episode: RolloutIdentity) -> None:
    parent, attempt, seen = None, 0, set()
    for index, row in enumerate(rows):
        where = f"ledger of {episode.capture_key}, row {index}"
        if row.parent_call_id != parent:
            raise InvalidCheckpointState(f"{where}: parent {row.parent_call_id!r}, expected {parent!r}")
        if not attempt <= row.attempt <= episode.attempt:
            raise InvalidCheckpointState(f"{where}: attempt {row.attempt} out of order")
        if row.call_id in seen:
            raise InvalidCheckpointState(f"{where}: call {row.call_id} appears twice")
        parent, attempt = row.call_id, row.attempt
        seen.add(row.call_id)
