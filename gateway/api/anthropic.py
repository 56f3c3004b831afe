"""Anthropic Messages API routes (`POST /v1/messages`, `POST /v1/messages/count_tokens`)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
