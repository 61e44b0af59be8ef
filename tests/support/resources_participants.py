"""The project's resources servers as checkpoint participants under test.

``SERVERS`` names every resources server of the project with its class; ``hooks_for`` gives the
test kit's ``ResourcesHooks`` for one (``nemo_gym_ckpt.testing.resources``), with the seed row its
state needs.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from nemo_gym_ckpt.resources.base import ResourcesServer
from nemo_gym_ckpt.testing.resources import ResourcesHooks
from resources_servers.calculator_tools.app import CalculatorTools
from resources_servers.kv_store.app import KvStore
from resources_servers.math_verify.app import MathVerify
from resources_servers.mcqa.app import Mcqa
from resources_servers.python_repl.app import PythonRepl
from resources_servers.string_match.app import StringMatch

__all__ = ["SERVERS", "WAIT_S", "hooks_for", "seed_row"]

WAIT_S = 10.0
SERVERS: dict[str, type[ResourcesServer[Any]]] = {
    "string_match": StringMatch,
    "calculator_tools": CalculatorTools,
    "math_verify": MathVerify,
    "mcqa": Mcqa,
    "kv_store": KvStore,
    "python_repl": PythonRepl,
}




def seed_row(implementation: str, payload: dict[str, Any]) -> dict[str, Any]:
    """A seed row carrying ``payload`` (kv_store: as the store's initial state)."""
    if implementation == "kv_store":
        return {"initial_state": {key: str(value) for key, value in payload.items()}}
    return dict(payload)


def hooks_for(implementation: str) -> ResourcesHooks:
    return ResourcesHooks(SERVERS[implementation], partial(seed_row, implementation))
