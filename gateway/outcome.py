"""What became of one proxied request: the proxy fills it in as the request goes, the app's metrics,
access log and cost, and its trace's spans, read it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Outcome:
    """What happened to one proxied request; filled in as it goes, read by metrics and the access log."""

    pool: str = "-"
    replica: str = "-"
    status: int = 0
    attempts: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # of the prompt, served from the engine's prefix cache (None: not reported)
    stream_error: str | None = None
    response_id: str | None = None  # a Responses answer's id (the replica holds it for follow-ups)
    engine_share_s: float = 0.0  # its share of its replicas' engine time over all attempts (fleet.engine_share)
