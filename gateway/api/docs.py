"""API documentation: the OpenAPI schema, Swagger UI at ``/docs`` and ReDoc at ``/redoc``.

Open in development; in production they need the admin key (the schema describes the admin routes too). The pages
are FastAPI's own, which load their scripts from a CDN in the reader's browser; ``/openapi.json`` itself is served
from here and works offline.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from gateway.api.deps import State, require_admin

router = APIRouter(include_in_schema=False)


async def _allowed(request: Request, state: Any) -> None:
    if state.settings.environment == "production":
        await require_admin(request, state)


@router.get("/openapi.json")
async def openapi(request: Request, state: State) -> JSONResponse:
    await _allowed(request, state)
    return JSONResponse(request.app.openapi())


@router.get("/docs")
async def swagger(request: Request, state: State) -> HTMLResponse:
    await _allowed(request, state)
    return get_swagger_ui_html(openapi_url="/openapi.json", title="clawgate API")


@router.get("/redoc")
async def redoc(request: Request, state: State) -> HTMLResponse:
    await _allowed(request, state)
    return get_redoc_html(openapi_url="/openapi.json", title="clawgate API")
