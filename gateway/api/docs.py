"""API documentation: the OpenAPI schema, Swagger UI at ``/docs`` and ReDoc at ``/redoc``.

Open in development; in production they need the admin key (the schema describes the admin routes too). The pages
are FastAPI's own, which load their scripts from a CDN in the reader's browser; ``/openapi.json`` itself is served
from here and works offline.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse

from gateway.deps import require_global_admin
from gateway.protocols.common.routes import HOISTED
from gateway.state import State

router = APIRouter(include_in_schema=False)


async def _allowed(request: Request, state: Any) -> None:
    if state.settings.environment == "production":
        await require_global_admin(request, state)


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with the serving routes' request models (``routing.HOISTED``) moved into the components."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            for name, model in operation.pop(HOISTED, {}).items():
                components.update(model.pop("$defs", {}))
                components[name] = model
    app.openapi_schema = schema
    return schema


@router.get("/openapi.json")
async def openapi(request: Request, state: State) -> JSONResponse:
    await _allowed(request, state)
    return JSONResponse(openapi_schema(request.app))


@router.get("/docs")
async def swagger(request: Request, state: State) -> HTMLResponse:
    await _allowed(request, state)
    return get_swagger_ui_html(openapi_url="/openapi.json", title="clawgate API")


@router.get("/redoc")
async def redoc(request: Request, state: State) -> HTMLResponse:
    await _allowed(request, state)
    return get_redoc_html(openapi_url="/openapi.json", title="clawgate API")
