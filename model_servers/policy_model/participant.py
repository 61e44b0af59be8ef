"""The policy model server as the checkpoint participant of kind ``model`` (docs/protocol.md section 8).

``mount_policy_participant`` is called only for the server with ``checkpoint_policy: true``; with
the mesh's checkpointing off it mounts nothing and returns ``None`` (the server is a plain one).
With it on, the routes serve through a ``CustodyBackend`` (admission, held replies, the ledger,
see ``custody``) and ``PolicyAdapter`` answers the control plane:

- readiness: blocked by streams that started to be delivered and have not drained; counts of
  active calls, held replies, ledgers and rows;
- export: one record per ledger in scope, ``{episode_id, ledger: [row, ...]}`` (see ``ledger``);
  held calls have no row; the token arrays of the exported calls that delivered them go to the
  token sidecar, written durably before the records (``token_sidecar``: the participant's store is
  a ``SidecarStore``), and each row names its line by ``token_digest``;
- install: every record checked (fields, lineage, the sidecar's tokens against the rows' digests),
  then installed under the next attempt;
- retire: the calls of the retired attempts stopped and awaited, then their ledgers dropped,
  cumulatively (the attempt and every earlier one of its rollout); refused by the participant
  while a checkpoint is open;
- forget: every ledger of those rollouts dropped.

The route ``GET /v1/capture/tokens`` (rollout-scoped, mounted only here) answers the calls of the
request's capture key, in lineage order, with their token fields where they delivered them
(``{"calls": [{call_id, attempt, policy_version, prompt_token_ids?, generation_token_ids?,
generation_log_probs?}]}``): a restored agent puts them back on the output items of the calls it
made before the checkpoint. It changes nothing and waits for nothing (a retired attempt is refused).

Why the model keeps the tokens and not the agent: the model produced them, checks them against its
ledger (the rows' digests say which ids were delivered, and held calls have no row), needs them
itself to splice a continued call's prompt (E10: never re-tokenize a restored conversation), and
serves any agent, including one that cannot keep a sidecar of its own; one file per commit per
policy model is also cheaper than one per agent instance.

Generation cuts (``generation_cuts: true``, see ``cuts``): at commit, before the export
(``before_export``, which gets the commit's deadline), the calls in flight are cut on the worker;
each durable cut goes into its episode's record; ``committed`` answers the kept ``staging_keys``
(those of every exported record, restored cuts included) and starts the settling of the cut with
the worker, which the commit's reply does not wait for. The cuts go over a client of their own
(``CONTROL_CONNECTIONS`` connections), never the data pool the generations being cut hold.

Generation hold (``hold_generation_in_checkpoints: true``, see ``generation_hold``): from the moment
the participant is ready inside a checkpoint (``paused``) to its resume (``resumed``) the worker
takes no decode steps; the commit extends the hold to its own deadline. Over the same control client.

The commit reply carries what NeMo RL's adapter checks: ``staging_keys`` (sorted, unique) and
``staging_keys_by_episode``: one entry per exported record, by the capture key of its
``episode_id`` (the checkpointed attempt), with the sorted staging keys of its cut (``[]`` for a
record without one); the union of its lists is exactly ``staging_keys``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from model_servers.policy_model.active_calls import ActiveCalls, CallState
from model_servers.policy_model.backend import Backend
from model_servers.policy_model.capture_memory import CaptureMemory
from model_servers.policy_model.custody import Custody, CustodyBackend
from model_servers.policy_model.cuts import CutClient, CutRecord, GenerationCutter
from model_servers.policy_model.generation_hold import GenerationHolder, HoldClient
from model_servers.policy_model.ledger import CUT_KEY, LedgerBook
from model_servers.policy_model.token_sidecar import CallTokens, SidecarStore
from nemo_gym_ckpt.checkpoint.adapter import ExportItem, Readiness
from nemo_gym_ckpt.checkpoint.clock import SYSTEM_CLOCK, Clock
from nemo_gym_ckpt.checkpoint.cut_wire import control_root
from nemo_gym_ckpt.checkpoint.mount import mount_checkpointing
from nemo_gym_ckpt.checkpoint.participant import Participant
from nemo_gym_ckpt.checkpoint.records import Record, Scope, episode_of
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.errors import RolloutIdRequired
from nemo_gym_ckpt.identity import RolloutIdentity, current_identity
from nemo_gym_ckpt.server import close_on_shutdown

__all__ = ["CAPTURE_TOKENS_PATH", "CONTROL_CONNECTIONS", "PolicyAdapter", "PolicyParticipant",
           "kept_staging_keys", "mount_policy_participant", "staging_keys_by_episode"]

CAPTURE_TOKENS_PATH = "/v1/capture/tokens"
CONTROL_CONNECTIONS = 8

logger = logging.getLogger(__name__)


class PolicyAdapter:
    """The ``ParticipantAdapter`` of the policy model: the active calls and the capture ledgers."""

    def __init__(
        self, calls: ActiveCalls, ledgers: LedgerBook, *, generation_cuts: bool = False,
        cutter: GenerationCutter | None = None,
    ) -> None:
        self.calls = calls
        self.ledgers = ledgers
        self.generation_cuts = generation_cuts
        self.cutter = cutter
        self.holder: GenerationHolder | None = None
        self._commit: tuple[str, float] | None = None  # (checkpoint id, deadline) of the commit running
        self._cuts: dict[RolloutIdentity, CutRecord] = {}
        self._kept: dict[str, list[str]] = {}  # capture key of each exported record -> its staging keys
        self._token_lines: list[CallTokens] = []  # the sidecar lines of the commit being written
        self._exported = 0.0  # when the export of the commit being written began (perf_counter)

    def counts(self) -> dict[str, int]:
        return {
            "active_calls": len(self.calls),
            "held_responses": self.calls.count(CallState.HELD),
            "delivering_streams": self.calls.count(CallState.DELIVERING),
            "ledgers": len(self.ledgers),
            "rows": self.ledgers.row_count,
            "token_bytes_in_memory": self.ledgers.memory.held if self.ledgers.memory else 0,
            "token_lines_spilled": self.ledgers.memory.spilled if self.ledgers.memory else 0,
        }

    async def readiness(self) -> Readiness:
        return Readiness(blockers=self.calls.delivering_keys(), counts=self.counts())

    def paused(self, checkpoint_id: str, until_ts: float) -> None:
        if self.holder is not None:
            self.holder.paused(checkpoint_id, until_ts)

    def resumed(self, checkpoint_id: str) -> None:
        if self.holder is not None:
            self.holder.resumed(checkpoint_id)

    async def before_export(self, checkpoint_id: str, scope: Scope | None, deadline_ts: float) -> None:
        """Cut the calls in flight (never fails: a failed cut leaves those calls to be generated again)."""
        self._commit, self._cuts = (checkpoint_id, deadline_ts), {}
        if self.holder is not None:
            self.holder.extend(checkpoint_id, deadline_ts)
        if self.cutter is not None:
            self._cuts = await self.cutter.cut(checkpoint_id, scope, deadline_ts, self.ledgers.lineage)

    async def export(self, scope: Scope | None) -> AsyncIterator[ExportItem]:
        for item in self._ledger_records(scope):
            yield item

    def export_at_once(self, scope: Scope | None) -> list[Record]:
        return [item if isinstance(item, Record) else Record.from_data(item) for item in self._ledger_records(scope)]

    def _ledger_records(self, scope: Scope | None) -> list[ExportItem]:
        """The ledgers' records, noting the sidecar lines and staging keys they name for the commit."""
        began = time.perf_counter()
        items, self._token_lines = self.ledgers.export(scope, self._cuts)
        self._kept = staging_keys_by_episode(items)
        if self.cutter is not None:
            self.cutter.timings["records_ms"] = round(1000 * (time.perf_counter() - began), 3)
        self._exported = began
        return items

    async def committed(self, scope: Scope | None) -> Mapping[str, Any]:
        if self.cutter is not None:  # from the export's start: the records built and written
            self.cutter.timings["export_and_write_ms"] = round(1000 * (time.perf_counter() - self._exported), 3)
        self.ledgers.drop_restored_outside(scope)
        by_episode, commit = self._kept, self._commit
        kept = sorted({key for keys in by_episode.values() for key in keys})
        self._commit, self._cuts, self._kept, self._token_lines = None, {}, {}, []
        if self.cutter is not None and commit is not None:
            self.cutter.settle(commit[0], kept, commit[1])  # in the background: the reply does not wait
        return {"staging_keys": kept, "staging_keys_by_episode": by_episode}

    def sidecar_lines(self) -> list[CallTokens]:
        """What the commit being written puts in its token sidecar (set by ``export``)."""
        return self._token_lines

    async def install(self, records: Sequence[Record], scope: Scope) -> None:
        self.ledgers.install(records)

    async def retire(self, episodes: Sequence[RolloutIdentity]) -> None:
        await self.calls.wait_closed(self.calls.stop(episodes))
        self.ledgers.retire(episodes)

    async def forget(self, rollout_ids: Sequence[str]) -> None:
        self.ledgers.forget(rollout_ids)

    def status_extras(self) -> Mapping[str, Any]:
        timings = {"generation_cut_ms": self.cutter.timings} if self.cutter and self.cutter.timings else {}
        hold = self.holder.status() if self.holder is not None else {}
        return {"checkpoint_policy": True, "generation_cuts": self.generation_cuts, **self.counts(), **timings,
                **hold}


def kept_staging_keys(items: Sequence[ExportItem]) -> list[str]:
    """The staging keys the cuts of exported records name."""
    return [key for keys in staging_keys_by_episode(items).values() for key in keys]


def staging_keys_by_episode(items: Sequence[ExportItem]) -> dict[str, list[str]]:
    """Capture key of each record's ``episode_id`` -> the sorted staging keys of its cut (``[]``)."""
    by_episode: dict[str, set[str]] = {}
    for item in items:
        data = item.data if isinstance(item, Record) else item
        episode = item.episode if isinstance(item, Record) else episode_of(item)
        keys = by_episode.setdefault(episode.capture_key, set())
        cut = data.get(CUT_KEY)
        if isinstance(cut, dict):
            keys.update(cut["staging_keys"])
    return {key: sorted(keys) for key, keys in by_episode.items()}


@dataclass
class PolicyParticipant:
    """What mounting made: the participant, its adapter and the backend the routes must use."""

    participant: Participant
    adapter: PolicyAdapter
    backend: CustodyBackend


def mount_policy_participant(
    app: FastAPI,
    ctx: ServerContext[Any],
    backend: Backend,
    *,
    worker_url: str | None = None,
    generation_cuts: bool = False,
    cut_control_url: str | None = None,
    clock: Clock = SYSTEM_CLOCK,
    capture_memory: CaptureMemory | None = None,
    hold_generation: bool = False,
) -> PolicyParticipant | None:
    """Mount the model participant on ``app`` (``None``, nothing mounted, with checkpointing off).

    With ``generation_cuts``, the cuts go to ``cut_control_url`` (default: ``worker_url`` without its
    ``/v1``) over a client of their own (``CONTROL_CONNECTIONS``): a cut never waits behind the calls
    generating on that worker. With ``hold_generation``, the worker there is held while a checkpoint
    is open, over the same client. ``capture_memory`` bounds the token lines the ledgers hold in memory.
    """
    calls, ledgers = ActiveCalls(), LedgerBook(capture_memory)
    adapter = PolicyAdapter(calls, ledgers, generation_cuts=generation_cuts)
    participant = mount_checkpointing(app, ctx, adapter, kind="model", clock=clock)
    if participant is None:
        return None
    participant.store = SidecarStore(participant.store, adapter.sidecar_lines)
    _mount_capture_route(app, participant, ledgers)
    if generation_cuts or hold_generation:
        if worker_url is None and cut_control_url is None:
            raise ValueError("generation cuts and holds need the inference worker's url (or a cut control url)")
        token = ctx.mesh.checkpoint.control_auth_token
        assert token is not None  # the config refuses checkpointing without a token
        control = ctx.client.for_control(CONTROL_CONNECTIONS)
        if control is not ctx.client:
            close_on_shutdown(app, control.aclose)
        url, secret = cut_control_url or control_root(worker_url or ""), token.get_secret_value()
        if generation_cuts:
            client = CutClient(control, url, secret, ctx.name)
            adapter.cutter = GenerationCutter(calls, client, participant.clock, participant.telemetry)
        if hold_generation:
            adapter.holder = GenerationHolder(HoldClient(control, url, secret), participant.clock)
    custody = Custody(participant, calls, ledgers, generation_cuts=generation_cuts)
    return PolicyParticipant(participant, adapter, CustodyBackend(backend, custody))


def _mount_capture_route(app: FastAPI, participant: Participant, ledgers: LedgerBook) -> None:
    async def capture_tokens() -> dict[str, Any]:
        identity = current_identity()
        if identity is None:
            raise RolloutIdRequired("the capture route is rollout-scoped: call it under /ng-rollout/<key>/")
        participant.marks.check(identity)
        return {"capture_key": identity.capture_key, "calls": ledgers.calls(identity)}

    app.add_api_route(CAPTURE_TOKENS_PATH, capture_tokens, methods=["GET"])
