"""Token arrays put back on a restored loop's output items, from the policy model's capture ledger.

Records never carry token arrays (docs/protocol.md section 6), so a loop state restored from a checkpoint
has output items without ``prompt_token_ids``, ``generation_token_ids`` and ``generation_log_probs``
for the model calls made before the checkpoint. The policy model kept them (its token sidecar) and
answers them for the rollout's capture key at ``GET /v1/capture/tokens``; ``reattach`` stamps them on
the items again, in the order the policy model writes them, so the rollout's output equals an
uninterrupted run's, and the next model call sends them back (its prompt is spliced from them).

Which items belong to which call: the loop appends each model call's items together, then one
``function_call_output`` per function call before the next model call (a call without function calls
ends the loop), so the runs of consecutive model items are the model calls, in the order of
``LoopState.model_calls`` (the ledger's call ids). A state where they do not line up, or a call the
policy model has no token ids for, is left as it is (and logged): its items then lack token arrays,
which training data can see, rather than carrying ids of another call.

``refill`` does the same for items the agent holds no loop state of: a completed reply restored
from a checkpoint and served again (docs/protocol.md section 7), and the items an environment kept at a
boundary after the agent was done (``POST /v1/responses/refill``). Without the ledger ids of the
calls, the items are matched by order: each run of consecutive model items (``is_model_item``:
assistant messages, function calls, reasoning; a function call output or an environment's own
message ends a run) is one model call, and the runs are the last calls of the rollout's lineage,
in order (a reply covers its activation's calls, the last ones made; a whole trajectory covers
them all). A run that already carries token arrays must carry those of its call, and there may not
be more runs than calls; otherwise nothing is stamped (and it is logged).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from agents.simple_agent.loop import LoopState
from nemo_gym_ckpt.capture import POLICY_VERSION, TOKEN_ARRAYS
from nemo_gym_ckpt.environment.base import is_model_item, lacks_token_arrays

__all__ = ["TOKEN_ARRAYS", "missing_calls", "model_call_items", "model_runs", "reattach", "refill"]

logger = logging.getLogger(__name__)

_ORDER = (*TOKEN_ARRAYS, POLICY_VERSION)


def _runs(items: list[dict[str, Any]], is_model: Callable[[dict[str, Any]], bool]) -> list[list[int]]:
    """The indices of each run of consecutive items that ``is_model`` holds for, in order."""
    runs: list[list[int]] = []
    previous_was_model = False
    for index, item in enumerate(items):
        model = is_model(item)
        if model and not previous_was_model:
            runs.append([])
        if model:
            runs[-1].append(index)
        previous_was_model = model
    return runs


def model_call_items(outputs: list[dict[str, Any]]) -> list[list[int]]:
    """The indices of the output items of each model call, in order."""
    return _runs(outputs, lambda item: item.get("type") != "function_call_output")


def _lacks_tokens(item: dict[str, Any]) -> bool:
    return not all(name in item for name in TOKEN_ARRAYS)


def missing_calls(state: LoopState) -> list[str]:
    """The ledger ids of the model calls whose output items lack token arrays."""
    groups = model_call_items(state.outputs)
    if len(groups) != len(state.model_calls):
        return []
    return [call_id for call_id, group in zip(state.model_calls, groups, strict=True)
            if call_id is not None and any(_lacks_tokens(state.outputs[i]) for i in group)]


def reattach(state: LoopState, calls: list[dict[str, Any]]) -> int:
    """Stamp the token arrays of ``calls`` (the capture route's answer) on the items of those calls
    that lack them; answers how many items were stamped."""
    groups = model_call_items(state.outputs)
    if len(groups) != len(state.model_calls):
        logger.warning("restored loop: %d runs of model items for %d model calls; token arrays not put back",
                       len(groups), len(state.model_calls))
        return 0
    known = {call["call_id"]: call for call in calls if all(name in call for name in TOKEN_ARRAYS)}
    stamped = 0
    for call_id, group in zip(state.model_calls, groups, strict=True):
        call = known.get(call_id) if call_id is not None else None
        lacking = [i for i in group if _lacks_tokens(state.outputs[i])]
        if not lacking:
            continue
        if call is None:
            logger.warning("restored loop: the policy model has no token ids of call %s", call_id)
            continue
        for index in lacking:
            state.outputs[index] = _stamped(state.outputs[index], call)
            stamped += 1
    return stamped


def _stamped(item: dict[str, Any], call: dict[str, Any]) -> dict[str, Any]:
    """The item with the call's token fields, last and in the policy model's order."""
    rest = {key: value for key, value in item.items() if key not in _ORDER}
    version = item["policy_version"] if "policy_version" in item else call.get("policy_version")
    return {**rest, **{name: call[name] for name in TOKEN_ARRAYS}, "policy_version": version}


def model_runs(items: list[dict[str, Any]]) -> list[list[int]]:
    """The indices of each run of consecutive model items (one model call each), in order."""
    return _runs(items, is_model_item)


def refill(items: list[dict[str, Any]], calls: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """``items`` with the token arrays of ``calls`` (the capture route's answer, the lineage in order)
    stamped on the model items that lack them, matched by order; and how many were stamped."""
    if not lacks_token_arrays(items):
        return items, 0
    runs = model_runs(items)
    if len(runs) > len(calls):
        logger.warning("refill: %d runs of model items but the policy model knows %d calls; token arrays "
                       "not put back", len(runs), len(calls))
        return items, 0
    matched = list(zip(runs, calls[len(calls) - len(runs):], strict=True))
    for run, call in matched:
        if any(not _lacks_tokens(items[i]) and not _same_tokens(items[i], call) for i in run):
            logger.warning("refill: the items do not line up with the policy model's calls (call %s); token "
                           "arrays not put back", call.get("call_id"))
            return items, 0
    refilled = list(items)
    stamped = 0
    for run, call in matched:
        if not all(name in call for name in TOKEN_ARRAYS):
            continue
        for index in run:
            if _lacks_tokens(refilled[index]):
                refilled[index] = _stamped(refilled[index], call)
                stamped += 1
    return refilled, stamped


def _same_tokens(item: dict[str, Any], call: dict[str, Any]) -> bool:
    return all(item.get(name) == call.get(name) for name in TOKEN_ARRAYS)
