"""The token of an ``Authorization`` header, for tenant keys and the admin token alike."""

from __future__ import annotations


def bearer_token(header: str) -> str | None:
    """``Bearer <token>`` -> the token; None for another scheme or none. The scheme is matched without
    regard to case (RFC 9110 11.1: ``bearer`` and ``BEARER`` are ``Bearer``)."""
    scheme, _, token = header.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None
