"""The benchmark's prompts: short chat requests on varied topics, the same in every phase."""

from __future__ import annotations

__all__ = ["TOPICS", "chat"]

TOPICS = ["a lighthouse", "the moon", "a robot", "coffee", "rivers", "a library", "winter", "trains", "bees",
          "the ocean", "a violin", "mountains", "a city at night", "gardens", "a storm", "friendship"]


def chat(i: int) -> list[dict[str, str]]:
    """The ``i``-th request's messages."""
    return [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]} (#{i})."}]
