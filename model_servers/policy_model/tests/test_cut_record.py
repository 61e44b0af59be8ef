"""A cut read back from a ledger record (``CutRecord.from_json``): every number within the wire's bounds."""

from __future__ import annotations

from typing import Any

import pytest

from model_servers.policy_model.cuts import CUT_FIELDS, CutRecord
from nemo_gym_ckpt.checkpoint.cut_wire import MAX_TOKENS
from nemo_gym_ckpt.errors import InvalidCheckpointState

pytestmark = pytest.mark.unit


def cut(**changes: Any) -> dict[str, Any]:
    data = {"source_call_id": "mc_1", "conversation_digest": "a" * 64, "parent_call_id": None,
            "previous_length": 0, "cut_kind": "active_prefix", "staging_keys": ["k1"],
            "prefix_token_count": 12, "prefix_digest": "b" * 64, "effective_output_limit": 40,
            "terminal_finish_reason": None, **changes}
    assert set(data) == set(CUT_FIELDS)
    return data


def test_a_cut_within_the_wire_bounds_reads_back() -> None:
    record = CutRecord.from_json(cut(prefix_token_count=MAX_TOKENS, effective_output_limit=MAX_TOKENS), "r1")
    assert record.to_json() == cut(prefix_token_count=MAX_TOKENS, effective_output_limit=MAX_TOKENS)


@pytest.mark.parametrize("field", ["prefix_token_count", "effective_output_limit", "previous_length"])
def test_a_count_past_the_wire_bound_is_refused_at_the_restore(field: str) -> None:
    with pytest.raises(InvalidCheckpointState, match=f"cut field {field}"):
        CutRecord.from_json(cut(**{field: MAX_TOKENS + 1}), "r1")
