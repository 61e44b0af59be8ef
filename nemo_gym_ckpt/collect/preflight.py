"""Reading a checkpoint's participant files before its restore is sent (docs/controller.md section 7).

Why before: once a restore went out, no other checkpoint can be restored on the same mesh
(docs/protocol.md sections 4 and 5). The restore goes to every participant at once, so when one of
them refuses its damaged files (``invalid_checkpoint_state``) the others have installed theirs, and
a participant that installed anything is not fresh any more: another restore is ``invalid_phase``.
And the coordinator's undo retires the next attempts N+1 of the scope everywhere, which fences every
attempt of those rollouts up to N+1 (retire marks are cumulative), while an older checkpoint holds
them at an attempt M <= N and its restore would install M+1 <= N+1: ``stale_attempt``. Only a
checkpoint refused before anything was sent leaves the mesh fresh and unfenced.

So ``check_files`` reads the files of every participant the collection manifest lists the way that
participant's restore will (``CheckpointStore.read``: the manifest, the records' SHA-256 and count,
the spans and patches into the linked records files of earlier checkpoints, the bound on a record's
size), keeping only the records of the scope, one participant at a time. A damaged checkpoint is
``InvalidCheckpointState`` naming the participant, and the collector goes on to an older one with the
mesh untouched. What it cannot see is a refusal of an adapter's own at install time (a record whose
content its kind does not accept): that restore is refused by the participants, undone, and its
rollouts start over.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from nemo_gym_ckpt.checkpoint.store import CheckpointStore
from nemo_gym_ckpt.collect.published import CollectionManifest
from nemo_gym_ckpt.errors import InvalidCheckpointState
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = ["check_files", "participant_of"]

_MANIFEST_FILE = "manifest.json"


def participant_of(name: str, manifest_path: str) -> tuple[str, str]:
    """The ``(kind, instance)`` of a participant manifest path ``gym/<kind>/<instance>/manifest.json``."""
    parts = PurePosixPath(manifest_path).parts
    if len(parts) != 4 or parts[0] != "gym" or parts[3] != _MANIFEST_FILE:
        raise InvalidCheckpointState(f"{name}: manifest path {manifest_path!r} is not "
                                     f"gym/<kind>/<instance>/{_MANIFEST_FILE}")
    return parts[1], parts[2]


def check_files(
    checkpoint: Path, manifest: CollectionManifest, scope: Iterable[RolloutIdentity], *, max_record_bytes: int,
) -> None:
    """``InvalidCheckpointState`` naming the first participant whose files in ``checkpoint`` (the
    checkpoint's directory) a restore of ``scope`` would refuse; nothing if every one reads."""
    store = CheckpointStore(None, max_record_bytes=max_record_bytes)
    episodes = frozenset(scope)
    for name, path in sorted(manifest.manifests.items()):
        kind, instance = participant_of(name, path)
        try:
            store.read(checkpoint, kind, instance, episodes)
        except InvalidCheckpointState as error:
            raise InvalidCheckpointState(f"{name}: {error.detail}") from None
