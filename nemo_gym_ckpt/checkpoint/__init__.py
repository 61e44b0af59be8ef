"""Checkpoint control plane: the participant every server mounts, and the coordinator.

docs/protocol.md is the contract. A server kind implements ``ParticipantAdapter`` and calls
``mount_checkpointing(app, ctx, adapter, kind=...)``; a controller drives the mesh with
``Coordinator`` (or ``nemo-gym-ckpt checkpoint ...``). ``docs/protocol-guide.md`` is the guide for
controller authors; ``nemo_gym_ckpt.testing.conformance`` holds the conformance suite.
"""

from __future__ import annotations

from nemo_gym_ckpt.checkpoint.adapter import ExportItem, ParticipantAdapter, Readiness
from nemo_gym_ckpt.checkpoint.clock import SYSTEM_CLOCK, Clock, SystemClock
from nemo_gym_ckpt.checkpoint.coordinator import (
    CommitResult,
    Coordinator,
    Outcome,
    ParticipantRef,
    PrepareResult,
    RestoreResult,
    StagedResult,
)
from nemo_gym_ckpt.checkpoint.fileops import FileOps
from nemo_gym_ckpt.checkpoint.mount import mount_checkpointing
from nemo_gym_ckpt.checkpoint.participant import KINDS, Participant
from nemo_gym_ckpt.checkpoint.phases import Phase
from nemo_gym_ckpt.checkpoint.records import Record, Scope
from nemo_gym_ckpt.checkpoint.router import CONTROL_PREFIX, make_router
from nemo_gym_ckpt.checkpoint.store import CheckpointStore, Manifest
from nemo_gym_ckpt.checkpoint.telemetry import Telemetry

__all__ = [
    "CONTROL_PREFIX",
    "KINDS",
    "SYSTEM_CLOCK",
    "CheckpointStore",
    "Clock",
    "CommitResult",
    "Coordinator",
    "ExportItem",
    "FileOps",
    "Manifest",
    "Outcome",
    "Participant",
    "ParticipantAdapter",
    "ParticipantRef",
    "Phase",
    "PrepareResult",
    "Readiness",
    "Record",
    "RestoreResult",
    "Scope",
    "StagedResult",
    "SystemClock",
    "Telemetry",
    "make_router",
    "mount_checkpointing",
]
