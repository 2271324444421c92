"""How fast a silent VM is given up, and how its attempts fence themselves: one set of knobs.

A VM can fail loudly (its port refuses connections) or silently (a hung kernel, a paused
VM, a network black hole: TCP connects, nothing answers). Every SSH step has a deadline
and keepalives notice a dead connection, so both cases end in bounded time:

- the poller renews each running attempt's lease on every successful poll (every
  `poll_interval_s`); a VM that has not answered a poll for `unreachable_timeout_s` is
  marked unreachable;
- the watchdog next to each attempt stops the training (TERM, then KILL after
  `fence_grace_s`) once its lease is `fence_after_s` old by the VM's own clock;
- the requeue manager fails the jobs of a VM silent for `node_lost_timeout_s` (counted
  from its last answer) as `node_lost` and runs them elsewhere;
- several pollers divide the VMs (`scheduler.gpu_poller.shares`): a poller holds its VMs
  for `poller_lease_s` after each renewal (renewed four times per lease); the VMs of one
  that dies or is cut off are polled by another within `poll_interval_s + poller_lease_s
  + poller_lease_s / 4` of their last poll, which must stay below `unreachable_timeout_s`
  (so no VM looks unreachable, nor fences its attempts, because its poller died).

The relations `problems()` checks keep a partitioned attempt stopped before its job is
given to another VM, and a VM that answers (even slowly) from ever fencing its attempts.
Every daemon reads the same environment variables, so one setting reaches them all.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

POLL_INTERVAL_ENV = "RLFLEET_POLL_INTERVAL"
POLL_TIMEOUT_ENV = "RLFLEET_POLL_TIMEOUT"
UNREACHABLE_TIMEOUT_ENV = "RLFLEET_UNREACHABLE_TIMEOUT"
NODE_LOST_TIMEOUT_ENV = "RLFLEET_NODE_LOST_TIMEOUT"
FENCE_AFTER_ENV = "RLFLEET_FENCE_AFTER"
FENCE_GRACE_ENV = "RLFLEET_FENCE_GRACE"
POLLER_LEASE_ENV = "RLFLEET_POLLER_LEASE"
SSH_CONNECT_TIMEOUT_ENV = "RLFLEET_SSH_CONNECT_TIMEOUT"
SSH_KEEPALIVE_INTERVAL_ENV = "RLFLEET_SSH_KEEPALIVE_INTERVAL"
SSH_KEEPALIVE_COUNT_ENV = "RLFLEET_SSH_KEEPALIVE_COUNT_MAX"

ENV_NAMES = {
    "poll_interval_s": POLL_INTERVAL_ENV,
    "poll_timeout_s": POLL_TIMEOUT_ENV,
    "unreachable_timeout_s": UNREACHABLE_TIMEOUT_ENV,
    "node_lost_timeout_s": NODE_LOST_TIMEOUT_ENV,
    "fence_after_s": FENCE_AFTER_ENV,
    "fence_grace_s": FENCE_GRACE_ENV,
    "poller_lease_s": POLLER_LEASE_ENV,
}
"""The environment variable of each `Liveness` knob (read by `Liveness.from_env` and by the
daemon commands' flags)."""

UNREACHABLE_AFTER_POLLS = 3
"""Failed polls in a row after which the poller marks a VM unreachable (it refuses
connections; a VM that hangs instead is caught by `unreachable_timeout_s`)."""

WATCHDOG_PERIOD_S = 1
"""How often the watchdog looks at its lease (it also reads the clock in whole seconds)."""
FENCE_SLACK_S = 2.0
"""What the watchdog may add to `fence_after_s`: one period plus the whole-second clock."""


@dataclass(frozen=True)
class Liveness:
    """The liveness knobs, in seconds; the defaults bound a silent VM as documented."""

    poll_interval_s: float = 5.0
    poll_timeout_s: float = 8.0
    unreachable_timeout_s: float = 8.0
    node_lost_timeout_s: float = 27.0
    fence_after_s: float = 18.0
    fence_grace_s: float = 5.0
    poller_lease_s: float = 0.0
    """How long a poller holds its VMs after a renewal; 0: derived from the poll interval
    and the unreachable timeout (`poller_lease`)."""

    def poller_lease(self) -> float:
        """The poller lease in seconds: `poller_lease_s`, or when 0 the longest that keeps
        a dead poller's VMs polled again before the unreachable timeout, with a margin:
        0.6 of (unreachable timeout - poll interval), between 0.2 s and 10 s
        (1.8 s with the defaults)."""
        if self.poller_lease_s > 0:
            return self.poller_lease_s
        return max(0.2, min(10.0, (self.unreachable_timeout_s - self.poll_interval_s) * 0.6))

    def poll_keepalive_s(self) -> float:
        """SSH keepalive interval of the poller's connections: a poll every interval, each
        with its deadline, already finds a dead connection (and abandons it); keepalives
        at the transport's 2 s would cost two round trips per poll on every VM. At
        `poll_interval_s + poll_timeout_s` none is sent while polls go on; a connection no
        longer polled (its VM now another poller's) still closes once dead."""
        return self.poll_interval_s + self.poll_timeout_s

    def takeover_gap_s(self) -> float:
        """Longest a VM goes unpolled when its poller dies: the interval it would have been
        polled at, then one lease, then one renewal of a surviving poller."""
        lease = self.poller_lease()
        return self.poll_interval_s + lease + lease / 4

    @classmethod
    def from_env(
        cls, given: Mapping[str, float | None] | None = None, env: Mapping[str, str] | None = None
    ) -> Liveness:
        """Knobs from `given` (flags by field name; None = not given), else the environment
        (RLFLEET_POLL_INTERVAL, …), else the defaults."""
        env = os.environ if env is None else env
        given = given or {}
        values: dict[str, float] = {}
        for f in fields(cls):
            name = ENV_NAMES[f.name]
            value = given.get(f.name)
            if value is None and env.get(name):
                value = _seconds(name, env[name])
            if value is not None:
                values[f.name] = float(value)
        return cls(**values)

    def problems(self) -> list[str]:
        """Why these knobs are unsafe together; empty when they are fine."""
        out = []
        if min(self.poll_interval_s, self.poll_timeout_s, self.unreachable_timeout_s) <= 0:
            out.append("poll interval, poll timeout and unreachable timeout must be > 0")
        if self.fence_grace_s < 0:
            out.append("fence grace must be >= 0")
        if self.unreachable_timeout_s <= self.poll_interval_s:
            out.append(
                f"unreachable timeout ({self.unreachable_timeout_s:g}s) must exceed the poll "
                f"interval ({self.poll_interval_s:g}s): a healthy VM would look lost"
            )
        if self.poller_lease_s > 0 and self.takeover_gap_s() >= self.unreachable_timeout_s:
            out.append(
                f"poller lease ({self.poller_lease_s:g}s): poll interval + lease + lease/4 "
                f"({self.takeover_gap_s():g}s) must stay below the unreachable timeout "
                f"({self.unreachable_timeout_s:g}s): the VMs of a poller that dies would be "
                "marked unreachable before another poller takes them"
            )
        if self.fence_after_s == 0:
            return out  # no watchdogs: nothing to keep consistent with them
        renewed = self.poll_interval_s + self.poll_timeout_s + FENCE_SLACK_S
        if self.fence_after_s < renewed:
            out.append(
                f"fence after ({self.fence_after_s:g}s) must be at least poll interval + poll "
                f"timeout + {FENCE_SLACK_S:g}s ({renewed:g}s): a VM that answers slowly would "
                "fence its own attempts"
            )
        dead_by = self.fence_after_s + FENCE_SLACK_S + self.fence_grace_s
        if self.node_lost_timeout_s < dead_by:
            out.append(
                f"node-lost timeout ({self.node_lost_timeout_s:g}s) must be at least fence "
                f"after + {FENCE_SLACK_S:g}s + fence grace ({dead_by:g}s): a job could start "
                "elsewhere before its partitioned attempt has stopped"
            )
        return out


def _seconds(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number of seconds") from None
    if value < 0:
        raise ValueError(f"{name}={text!r} must be >= 0")
    return value


@dataclass(frozen=True)
class SSHDeadlines:
    """The SSH transport's deadlines: connect (TCP, handshake and login) and keepalives."""

    connect_timeout_s: float = 5.0
    keepalive_interval_s: float = 2.0
    keepalive_count_max: int = 3

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SSHDeadlines:
        """From RLFLEET_SSH_CONNECT_TIMEOUT / _KEEPALIVE_INTERVAL / _KEEPALIVE_COUNT_MAX."""
        env = os.environ if env is None else env
        base = cls()
        connect = env.get(SSH_CONNECT_TIMEOUT_ENV)
        interval = env.get(SSH_KEEPALIVE_INTERVAL_ENV)
        count = env.get(SSH_KEEPALIVE_COUNT_ENV)
        if count and not count.isdigit():
            raise ValueError(f"{SSH_KEEPALIVE_COUNT_ENV}={count!r} is not a whole number")
        return cls(
            connect_timeout_s=_seconds(SSH_CONNECT_TIMEOUT_ENV, connect)
            if connect
            else base.connect_timeout_s,
            keepalive_interval_s=_seconds(SSH_KEEPALIVE_INTERVAL_ENV, interval)
            if interval
            else base.keepalive_interval_s,
            keepalive_count_max=max(1, int(count)) if count else base.keepalive_count_max,
        )

    @property
    def dead_after_s(self) -> float:
        """Longest a silent connection stays open: keepalives unanswered, then closed."""
        return self.keepalive_interval_s * (self.keepalive_count_max + 1)
