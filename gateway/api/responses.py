"""The OpenAI Responses API route, `POST /v1/responses`; ``gateway.serving.responses`` does the work."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.api.routing import add_serving_route
from gateway.protocol.responses import ResponseObject
from gateway.serving.responses import ResponsesServing

router = APIRouter()
add_serving_route(router, "/v1/responses", ResponsesServing, ResponseObject, name="create_response")
