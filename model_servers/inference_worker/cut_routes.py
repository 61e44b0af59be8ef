"""The worker's generation-cut routes (mounted only when the mesh's checkpointing is on).

| method | path | does |
|---|---|---|
| POST | ``/ng-control/v1/generation-cut`` | freeze, stage, receipt per ticket (``GenerationCuts.cut``) |
| POST | ``/ng-control/v1/generation-cut/keep`` | settle a checkpoint's cut: kept keys stay, others go |
| GET | ``/ng-control/v1/generation-cut/status`` | live generations, staging counts, token counters |

Every route checks ``Authorization: Bearer <control_auth_token>`` first, in constant time, before
it reads the body (401 ``unauthorized``); bodies are then parsed strictly (400 ``invalid_request``).
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import APIRouter, Request

from model_servers.inference_worker.cut_models import CutRequest, KeepRequest, parse_strict
from model_servers.inference_worker.generation_cuts import GenerationCuts
from nemo_gym_ckpt.errors import PayloadTooLarge, Unauthorized
from nemo_gym_ckpt.server import OrjsonResponse, declare_body

__all__ = ["CUT_PREFIX", "MAX_BODY_BYTES", "bounded_body", "check_bearer", "make_cut_router"]

CUT_PREFIX = "/ng-control/v1/generation-cut"
MAX_BODY_BYTES = 32 * 1024 * 1024


def check_bearer(request: Request, expected: bytes) -> None:
    """``Unauthorized`` unless the request carries ``Bearer <expected>`` (compared in constant time)."""
    scheme, _, presented = request.headers.get("authorization", "").partition(" ")
    given = presented.strip().encode("latin-1")
    if not (scheme.lower() == "bearer" and hmac.compare_digest(given, expected)):
        raise Unauthorized("missing or wrong control bearer token")


async def bounded_body(request: Request, limit: int = MAX_BODY_BYTES, what: str = "generation-cut") -> bytes:
    """The request's body, read as it comes; ``PayloadTooLarge`` once it passes ``limit`` bytes."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"{what} bodies are limited to {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def make_cut_router(cuts: GenerationCuts, token: str) -> APIRouter:
    if not token:
        raise ValueError("a control auth token is required")
    expected = token.encode()
    router = APIRouter(prefix=CUT_PREFIX, default_response_class=OrjsonResponse)

    @router.post("", openapi_extra=declare_body(CutRequest))
    async def cut(request: Request) -> dict[str, Any]:
        check_bearer(request, expected)
        return await cuts.cut(parse_strict(CutRequest, await bounded_body(request)))

    @router.post("/keep", openapi_extra=declare_body(KeepRequest))
    async def keep(request: Request) -> dict[str, Any]:
        check_bearer(request, expected)
        return await cuts.keep(parse_strict(KeepRequest, await bounded_body(request)))

    @router.get("/status")
    async def status(request: Request) -> dict[str, Any]:
        check_bearer(request, expected)
        return cuts.status()

    return router
