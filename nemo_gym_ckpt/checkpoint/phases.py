"""The participant's lifecycle: a small enum of phases and ONE guarded transition table.

docs/protocol.md section 4::

    idle --prepare--> preparing --(ready)--> prepared --commit--> committed
    idle --restore--> restored
    preparing | prepared | committed | restored --resume--> idle
    retire, forget: in idle or restored; renew: in any open phase; status: always

``advance(phase, op)`` is the only way a phase changes; an op that is not allowed raises
``InvalidPhase`` saying "expected X, got Y".
"""

from __future__ import annotations

from enum import StrEnum

from nemo_gym_ckpt.errors import InvalidPhase

__all__ = ["OPEN_PHASES", "TRANSITIONS", "Op", "Phase", "advance", "allowed_from"]


class Phase(StrEnum):
    IDLE = "idle"
    PREPARING = "preparing"
    PREPARED = "prepared"
    COMMITTED = "committed"
    RESTORED = "restored"


class Op(StrEnum):
    PREPARE = "prepare"
    READY = "ready"  # internal: the readiness wait of a prepare succeeded
    COMMIT = "commit"
    RESTORE = "restore"
    RESUME = "resume"
    RENEW = "renew"
    RETIRE = "retire"
    FORGET = "forget"


OPEN_PHASES = frozenset({Phase.PREPARING, Phase.PREPARED, Phase.COMMITTED, Phase.RESTORED})

TRANSITIONS: dict[tuple[Op, Phase], Phase] = {
    (Op.PREPARE, Phase.IDLE): Phase.PREPARING,
    (Op.PREPARE, Phase.PREPARING): Phase.PREPARING,  # a retried prepare re-enters the wait
    (Op.READY, Phase.PREPARING): Phase.PREPARED,
    (Op.COMMIT, Phase.PREPARED): Phase.COMMITTED,
    (Op.RESTORE, Phase.IDLE): Phase.RESTORED,
    **{(Op.RESUME, phase): Phase.IDLE for phase in OPEN_PHASES},
    **{(Op.RENEW, phase): phase for phase in OPEN_PHASES},
    **{(op, phase): phase for op in (Op.RETIRE, Op.FORGET) for phase in (Phase.IDLE, Phase.RESTORED)},
}


def allowed_from(op: Op) -> list[Phase]:
    """The phases ``op`` may start from, in lifecycle order."""
    return [phase for phase in Phase if (op, phase) in TRANSITIONS]


def advance(phase: Phase, op: Op) -> Phase:
    """The phase after ``op``; ``InvalidPhase`` ("expected X, got Y") if ``op`` is not allowed."""
    try:
        return TRANSITIONS[(op, phase)]
    except KeyError:
        expected = " or ".join(allowed_from(op))
        raise InvalidPhase(f"{op} expected phase {expected}, got {phase}", op=op, phase=phase) from None
