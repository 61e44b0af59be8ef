"""The worker's generation-hold routes (mounted only when the mesh's checkpointing is on).

| method | path | does |
|---|---|---|
| POST | ``/ng-control/v1/generation-hold`` | ``{checkpoint_id, seconds}``: no decode steps until released or expired |
| POST | ``/ng-control/v1/generation-hold/release`` | ``{checkpoint_id}``: end that checkpoint's hold |
| GET | ``/ng-control/v1/generation-hold`` | ``{held_by, holds, releases, expired, late_holds, held_ms}`` |

Every route checks ``Authorization: Bearer <control_auth_token>`` first (401 ``unauthorized``);
bodies are at most ``MAX_BODY_BYTES`` (413) and parsed strictly (``hold_wire``) (400 ``invalid_request``, also for an
engine that cannot hold: vLLM's, see ``generation_hold``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from model_servers.inference_worker.cut_models import parse_strict
from model_servers.inference_worker.cut_routes import bounded_body, check_bearer
from model_servers.inference_worker.generation_hold import GenerationHold
from nemo_gym_ckpt.checkpoint.hold_wire import HOLD_ROUTE, HoldRequest, ReleaseRequest
from nemo_gym_ckpt.server import OrjsonResponse, declare_body

__all__ = ["MAX_BODY_BYTES", "make_hold_router"]

MAX_BODY_BYTES = 4096


async def _body(request: Request) -> bytes:
    return await bounded_body(request, MAX_BODY_BYTES, "generation-hold")


def make_hold_router(hold: GenerationHold, token: str) -> APIRouter:
    if not token:
        raise ValueError("a control auth token is required")
    expected = token.encode()
    router = APIRouter(prefix=HOLD_ROUTE, default_response_class=OrjsonResponse)

    @router.post("", openapi_extra=declare_body(HoldRequest))
    async def hold_generation(request: Request) -> dict[str, Any]:
        check_bearer(request, expected)
        return hold.hold(parse_strict(HoldRequest, await _body(request)))

    @router.post("/release", openapi_extra=declare_body(ReleaseRequest))
    async def release_generation(request: Request) -> dict[str, Any]:
        check_bearer(request, expected)
        return hold.release(parse_strict(ReleaseRequest, await _body(request)))

    @router.get("")
    async def hold_status(request: Request) -> dict[str, Any]:
        check_bearer(request, expected)
        return hold.status()

    return router
