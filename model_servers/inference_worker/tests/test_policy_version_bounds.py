"""The policy version is a 64-bit integer: a larger one is refused, never stored.

A version of 2**64 was once stored, and then every completion answered 500 (the JSON encoder's
"Integer exceeds 64-bit range") until a valid version was posted.
"""

from __future__ import annotations

import pytest

from model_servers.inference_worker.tests.conftest import WorkerClient
from model_servers.inference_worker.tests.scripted_engine import ScriptedEngine
from model_servers.inference_worker.tests.test_app import complete

pytestmark = pytest.mark.unit


async def test_an_out_of_range_version_is_refused_and_completions_go_on(worker_client: WorkerClient) -> None:
    async with worker_client(ScriptedEngine.from_text("ab"), policy_version=3) as http:
        refused = [await http.post("/ng-control/v1/policy-version", json={"policy_version": value})
                   for value in (2**64, 2**63, 10**30)]
        kept = (await http.get("/ng-control/v1/policy-version")).json()
        after = await complete(http, max_tokens=1)
        largest = await http.post("/ng-control/v1/policy-version", json={"policy_version": 2**63 - 1})
        stamped = await complete(http, max_tokens=1)
    assert [reply.status_code for reply in refused] == [400, 400, 400]
    assert all(reply.json()["error"]["code"] == "invalid_request" for reply in refused)
    assert kept == {"policy_version": 3} and after["policy_version"] == 3
    assert largest.status_code == 200 and stamped["policy_version"] == 2**63 - 1
