"""Parsing of OpenAI-style server-sent event streams (what vLLM's streaming endpoints send)."""

from __future__ import annotations

import json


class StreamError(Exception):
    """The server answered, but not with a well-formed completion stream."""


def parse_sse_line(line: str) -> dict | None:
    """One line of an OpenAI-style event stream -> its JSON payload; None for blank lines,
    comments and the final `data: [DONE]`."""
    line = line.strip()
    if not line or line.startswith(":") or not line.startswith("data:"):
        return None
    payload = line[len("data:") :].strip()
    if payload == "[DONE]":
        return None
    try:
        return json.loads(payload)
    except json.JSONDecodeError as e:
        raise StreamError(f"malformed stream event: {payload[:200]!r}") from e
