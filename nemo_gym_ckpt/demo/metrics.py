"""What the demo's checkpoint saved and cost, read from the checkpoint's records and the final rows.

For the rollouts a restore continued (attempt N checkpointed, N+1 restored):

- ``continued_model_calls_skipped``: the capture-ledger rows of the model's records for them: model
  calls delivered before the checkpoint, never made again; ``continued_tokens_skipped`` sums their
  output lengths;
- ``cut_calls``: the generation cuts the model's records keep for them (a record's ``cut``);
  ``cut_tokens_staged`` sums their ``prefix_token_count``: the tokens those calls had produced when
  the commit cut them; ``staging_keys``: how many keys the commit answered (every exported cut);
- ``tokens_kept``: the tokens the restored worker served from staged prefixes instead of generating
  them (its cut status ``tokens_from_staging``, read after the restored run; the worker is a fresh
  process, so it counts the restored run only);
- ``tokens_regenerated``: tokens of cut calls produced before the checkpoint and generated again
  after it: ``cut_tokens_staged - tokens_kept`` (each staged prefix is continued at most once; a cut
  call that did not continue its prefix generates all of it again). 0 when every cut was continued;
- ``tokens_after_cut``: what the cut calls generated after their cut point (after the commit, before
  the crash, which waits for every call in flight to finish); after the restore it is generated
  again, as the continuation of the staged prefix;
- ``uncut_calls`` / ``tokens_regenerated_uncut``: the calls in flight at the checkpoint that were not
  cut (``calls_in_flight_at_checkpoint``, the model's count at the crash when every one of them had
  finished generating, less the cut ones): held (finished before the commit) or not started on the
  worker. Each is lost and is the first model call its rollout makes after the restore, with the
  same tokens (greedy decoding), all generated again. Their rollouts are known only when every
  candidate (a continued rollout without a cut whose next action was a model call) had one in
  flight; when not, the candidates' mean stands in and ``tokens_regenerated_uncut_exact`` is false;
- ``uncut_checkpoints_before``: checkpoints the demo took and resumed from before the one it
  crashed after, because they caught no call mid-generation (cuts on; at most ``CUT_TRIES`` - 1).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from nemo_gym_ckpt.collect.control import Published, Restored
from nemo_gym_ckpt.collect.published import COLLECTION_FILE, CollectionManifest
from nemo_gym_ckpt.collect.rows import read_jsonl
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = ["CrashState", "checkpoint_metrics", "model_calls_of"]


@dataclass
class CrashState:
    """What the demo saw when it killed the mesh."""

    published: Published | None = None
    model: dict[str, Any] = field(default_factory=dict)
    """The model participant's status extras at the crash."""
    rows_written: int = 0
    killed: list[str] = field(default_factory=list)
    uncut_checkpoints: int = 0
    """Checkpoints published before the crash's that caught no call mid-generation (with cuts on,
    the demo takes another one while rollouts are still to start: ``CUT_TRIES``)."""


def _records(checkpoint: Path, manifest: CollectionManifest, kind: str) -> dict[str, dict[str, Any]]:
    """The records of the participant of ``kind``, by capture key (empty if it has none)."""
    records: dict[str, dict[str, Any]] = {}
    for path in manifest.manifests.values():
        if path.split("/")[1] != kind:
            continue
        participant = orjson.loads((checkpoint / path).read_bytes())
        for record in read_jsonl(checkpoint / Path(path).parent / participant["records_file"]):
            episode = RolloutIdentity(record["episode_id"]["rollout_id"], record["episode_id"]["attempt"])
            records[episode.capture_key] = record
    return records


_MODEL_ITEMS = ("function_call", "message")


def model_calls_of(row: Mapping[str, Any]) -> tuple[list[list[int]], int]:
    """The generated token ids of each model call of a rollout row that carries them, in order (the
    items of one call share its prompt), and how many model outputs carry none (restored ones)."""
    calls: list[list[int]] = []
    last_prompt: Any = None
    bare = 0
    for item in row.get("response", {}).get("output", []):
        tokens = item.get("generation_token_ids")
        if not isinstance(tokens, list):
            bare += item.get("type") in _MODEL_ITEMS
        elif item.get("prompt_token_ids") != last_prompt or not calls:
            calls.append(tokens)
            last_prompt = item.get("prompt_token_ids")
    return calls, bare


def _next_is_model_call(agent_record: Mapping[str, Any] | None) -> bool:
    """Whether the agent session, at its checkpointed boundary, was to call the model next."""
    running = (agent_record or {}).get("session", {}).get("running")
    if running is None:
        return False
    state = running.get("state")
    return state is None or (not state.get("pending") and state.get("stop_reason") is None)


@dataclass(frozen=True)
class _Episode:
    checkpointed: RolloutIdentity
    ledger: list[dict[str, Any]]
    cut: dict[str, Any] | None
    calls: list[list[int]]
    bare: int

    @property
    def first_after(self) -> list[int]:
        """The tokens of its first model call after the restore (empty if it made none). The calls
        restored from the checkpoint come back without token arrays, or, if they kept them, are the
        first ones of the ledger."""
        index = 0 if self.bare else len(self.ledger)
        return self.calls[index] if index < len(self.calls) else []


def _episodes(
    checkpoint: Path, manifest: CollectionManifest, continued: Sequence[RolloutIdentity], output: Path
) -> list[_Episode]:
    model = _records(checkpoint, manifest, "model")
    rows = {f"{row['_ng_task_index']}-{row['_ng_rollout_index']}": row for row in read_jsonl(output)}
    episodes = []
    for restored in continued:
        checkpointed = RolloutIdentity(restored.rollout_id, restored.attempt - 1)
        record = model.get(checkpointed.capture_key, {})
        calls, bare = model_calls_of(rows.get(restored.rollout_id, {}))
        ledger = list(record.get("ledger", []))
        episodes.append(_Episode(checkpointed, ledger, record.get("cut"), calls, bare))
    return episodes


def _uncut_regenerated(
    episodes: Sequence[_Episode], agent: Mapping[str, Any], uncut: int
) -> tuple[int, bool]:
    """Output tokens of the ``uncut`` calls in flight that were generated again, and whether exact."""
    if uncut == 0:
        return 0, True
    candidates = [e for e in episodes if e.cut is None and e.first_after
                  and _next_is_model_call(agent.get(e.checkpointed.capture_key))]
    lengths = [len(e.first_after) for e in candidates]
    if uncut == len(candidates):
        return sum(lengths), True
    mean = sum(lengths) / len(lengths) if lengths else 0.0
    return round(mean * uncut), False


def checkpoint_metrics(
    checkpoint: Path, restored: Restored, crash: CrashState, output: Path,
    cut_status: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The demo's numbers about its checkpoint (see the module docstring); ``cut_status``: the
    restored worker's generation-cut status (``None``: generation cuts were off)."""
    continued = restored.continued
    manifest = CollectionManifest.from_json((checkpoint / COLLECTION_FILE).read_bytes(), checkpoint)
    episodes = _episodes(checkpoint, manifest, continued, output)
    agent = _records(checkpoint, manifest, "agent")
    in_flight = int(crash.model.get("active_calls", 0))
    cut = [e for e in episodes if e.cut is not None]
    staged = sum(int(e.cut["prefix_token_count"]) for e in cut if e.cut is not None)
    after_cut = sum(max(0, len(e.first_after) - int(e.cut["prefix_token_count"])) for e in cut if e.cut)
    kept = int((cut_status or {}).get("tokens_from_staging", 0))
    uncut = max(0, in_flight - len(cut))
    regenerated_uncut, exact = _uncut_regenerated(episodes, agent, uncut)
    staging = sum(len(keys) for keys in manifest.staging_keys.values())
    return {
        "rollouts_in_flight": len(manifest.continued) + len(manifest.restarted),
        "restored_episodes": len(continued),
        "restarted_episodes": len(restored.restarted),
        "continued_model_calls_skipped": sum(len(e.ledger) for e in episodes),
        "continued_tokens_skipped": sum(int(row["output_length"]) for e in episodes for row in e.ledger),
        "calls_in_flight_at_checkpoint": in_flight,
        "generation_cuts": cut_status is not None,
        "cut_calls": len(cut),
        "staging_keys": staging,
        "cut_tokens_staged": staged,
        "tokens_kept": kept,
        "tokens_regenerated": max(0, staged - kept),
        "tokens_after_cut": after_cut,
        "uncut_calls": uncut,
        "uncut_checkpoints_before": crash.uncut_checkpoints,
        "tokens_regenerated_uncut": regenerated_uncut,
        "tokens_regenerated_uncut_exact": exact,
    }
