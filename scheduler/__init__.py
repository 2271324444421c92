"""rlfleet scheduler: Postgres-backed, NATS-driven GRPO job scheduling over SSH."""

from __future__ import annotations

__version__ = "0.1.0"
