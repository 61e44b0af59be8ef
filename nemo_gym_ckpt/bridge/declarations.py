"""The checkpoint declarations of NeMo Gym's servers in this mesh (docs/verifiers.md).

NeMo Gym 0.7.0 ships its resources servers without checkpoint declarations, and a server that
declares nothing is ``restart_only`` (every rollout that used it starts over after a crash). The
twenty training verifiers the upstream checkpoint work declares are listed here, in code, each
``stateless`` (a verifier keeps nothing per session that a checkpoint must hold) and ``replay``
(a ``/verify`` in flight never holds a checkpoint; after a crash it simply runs again). Config can
neither set nor weaken a declaration (``nemo_gym_ckpt.config`` refuses the keys).

``declaration_of(server_class, module)`` is what a server's process uses, in this order:

1. the class's own ``checkpoint_mode`` / ``checkpoint_verify`` attributes (upstream's names: that
   is how a user declares a NeMo Gym server of their own, and how a later NeMo Gym release would);
2. this table, for NeMo Gym's own servers (``resources_servers.<name>.app`` of the ``nemo_gym``
   distribution);
3. ``restart_only`` / ``wait``, NeMo Gym's default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from nemo_gym_ckpt.resources.shell import Declaration

__all__ = [
    "DEFAULT_DECLARATION",
    "NEMO_GYM_VERIFIERS",
    "STATELESS_REPLAY",
    "Family",
    "Verifier",
    "declaration_of",
]

Family = Literal["rule", "judge", "code", "cohort"]
STATELESS_REPLAY = Declaration("stateless", "replay")
DEFAULT_DECLARATION = Declaration("restart_only", "wait")


@dataclass(frozen=True)
class Verifier:
    """One of NeMo Gym's training verifiers: where it is, what it is, whether it runs here."""

    name: str
    """Its folder: ``resources_servers/<name>/`` in the nemo_gym distribution, and
    ``resources_servers/nemo_gym/<name>/`` here (its config, rows and README)."""
    server_class: str
    """The ``SimpleResourcesServer`` subclass its ``app.py`` runs."""
    family: Family
    declaration: Declaration = STATELESS_REPLAY
    cannot_run_here: str | None = None
    """Why it cannot run on this machine (offline), or ``None``."""

    @property
    def module(self) -> str:
        return f"resources_servers.{self.name}.app"


def _table(*verifiers: Verifier) -> Mapping[str, Verifier]:
    return {verifier.name: verifier for verifier in verifiers}


NEMO_GYM_VERIFIERS: Mapping[str, Verifier] = _table(
    Verifier("code_gen", "CompCodingResourcesServer", "code"),
    Verifier("competitive_coding_challenges", "CompetitiveCodingChallengesResourcesServer", "code"),
    Verifier("equivalence_llm_judge", "LLMJudgeResourcesServer", "judge"),
    Verifier("math_with_judge", "LibraryJudgeMathResourcesServer", "rule"),
    Verifier("genrm_compare", "GenRMCompareResourcesServer", "cohort"),
    Verifier("abstention", "AbstentionServer", "judge"),
    Verifier("calendar", "CalendarResourcesServer", "rule"),
    Verifier("equivalence_rule", "EquivalenceRuleResourcesServer", "rule"),
    Verifier("ether0", "Ether0ResourcesServer", "rule", cannot_run_here=(
        "its app.py runs `git clone https://github.com/Future-House/ether0` when it is imported (no "
        "network here), and ether0 is not on the package registry")),
    Verifier("format_verification", "FormatVerificationResourcesServer", "rule"),
    Verifier("instruction_following", "InstructionFollowingResourcesServer", "rule", cannot_run_here=(
        "its requirement verifiable_instructions exists only as a git URL (not on the package registry), "
        "its spaCy model only as a GitHub release URL, and it downloads nltk's punkt_tab at run time")),
    Verifier("inverse_if", "InverseIFServer", "judge"),
    Verifier("jailbreak_detection", "JailbreakDetectionResourcesServer", "judge"),
    Verifier("mcqa", "MCQAResourcesServer", "rule"),
    Verifier("multichallenge", "MultiChallengeServer", "judge"),
    Verifier("nvarc", "NVARCResourcesServer", "code"),
    Verifier("reasoning_gym", "ReasoningGymResourcesServer", "rule"),
    Verifier("string_match", "StringMatchResourcesServer", "rule"),
    Verifier("structured_outputs", "StructuredOutputsResourcesServer", "rule"),
    Verifier("terminus_judge", "TerminusJudgeResourcesServer", "judge"),
)


def declaration_of(server_class: type, module: str) -> Declaration:
    """The declaration a server's process applies (the module docstring gives the order)."""
    mode = getattr(server_class, "checkpoint_mode", None)
    verify = getattr(server_class, "checkpoint_verify", None)
    if mode is not None or verify is not None:
        return Declaration(mode or DEFAULT_DECLARATION.checkpoint_mode,
                           verify or DEFAULT_DECLARATION.checkpoint_verify)
    for verifier in NEMO_GYM_VERIFIERS.values():
        if verifier.module == module and verifier.server_class == server_class.__name__:
            return verifier.declaration
    return DEFAULT_DECLARATION
