"""OpenAI Responses API routes (`POST /v1/responses`)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
