"""The wait between NATS reconnect attempts of a daemon."""

from __future__ import annotations

from scheduler.bus import ReconnectBackoff


def test_waits_double_from_the_base_up_to_the_cap_with_jitter() -> None:
    """Given failures in a row, each wait is base × 2^(n-1), capped, within ±25 %."""
    backoff = ReconnectBackoff(base_s=0.5, max_s=10.0)
    expected = [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    for nominal in expected:
        wait = backoff.failed()
        assert nominal * 0.75 <= wait <= nominal * 1.25, (nominal, wait)
    assert backoff.failures == len(expected)


def test_a_reconnect_starts_the_next_outage_from_the_base() -> None:
    """Once connected again, the first wait of the next outage is the base wait."""
    backoff = ReconnectBackoff(base_s=0.5, max_s=10.0)
    for _ in range(40):  # a long outage must not overflow the doubling
        backoff.failed()
    assert backoff.reset() == 0.5
    assert 0.375 <= backoff.failed() <= 0.625


def test_jitter_spreads_a_fleet_of_daemons() -> None:
    """Daemons that lost the server together do not all retry at the same instant."""
    waits = {round(ReconnectBackoff(1.0, 10.0).failed(), 6) for _ in range(50)}
    assert len(waits) > 40
