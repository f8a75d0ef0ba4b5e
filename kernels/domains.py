"""The request domains: the classifier's labels, the load tester's prompt corpora and the performance
model's speculative-acceptance keys all name these (here, at the bottom, so that each may import them)."""

from __future__ import annotations

DOMAINS: tuple[str, ...] = (
    "code",
    "math",
    "summarization",
    "extraction",
    "classification",
    "creative_writing",
    "brainstorming",
    "qa",
    "chat",
)


def unknown_domain(name: object) -> str:
    """The reason a domain that is not one of DOMAINS is refused (an unknown one would be sent chat
    prompts under its own label)."""
    return f"unknown domain {name!r}; domains: {', '.join(DOMAINS)}"
