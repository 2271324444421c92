"""Which failures become exit 64, 75, or propagate."""

from __future__ import annotations

import pytest
import torch

from training.errors import TransientError, UsageError, exit_code_for, one_line


class ReadTimeout(Exception):
    """Named like requests/httpx's timeout, which is all the classifier looks at."""


def _chained(outer: Exception, inner: BaseException) -> Exception:
    try:
        try:
            raise inner
        except BaseException as exc:
            raise outer from exc
    except Exception as exc:
        return exc


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (UsageError("bad"), 64),
        (TransientError("later"), 75),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), 75),
        (RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"), 75),
        (TimeoutError("timed out"), 75),
        (_chained(OSError("couldn't connect to the hub"), ReadTimeout("read timed out")), 75),
        (ValueError("a bug"), None),
        (RuntimeError("shape mismatch"), None),
        (_chained(OSError("no such file"), FileNotFoundError("x")), None),
    ],
)
def test_exit_code_for(exc: BaseException, code: int | None):
    assert exit_code_for(exc) == code


def test_one_line_keeps_the_first_non_empty_line():
    assert one_line(ValueError("\n  first\nsecond")) == "first"
    assert one_line(KeyError()) == "KeyError"


def test_connection_errors_are_transient_unless_offline_on_purpose(
    monkeypatch: pytest.MonkeyPatch,
):
    from huggingface_hub.errors import OfflineModeIsEnabled

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    assert exit_code_for(ConnectionError("Couldn't reach 'x' on the Hub (ConnectionError)")) == 75
    assert exit_code_for(ConnectionResetError("reset by peer")) == 75
    assert exit_code_for(_chained(OSError("cannot load"), OfflineModeIsEnabled("offline"))) is None
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert exit_code_for(ConnectionError("Couldn't reach 'x' on the Hub")) is None


def test_a_reward_s_connection_errors_are_transient_even_offline(monkeypatch: pytest.MonkeyPatch):
    from training.errors import is_network_timeout

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    refused = ConnectionRefusedError(111, "Connection refused")
    assert not is_network_timeout(refused)  # Loading from the hub while offline: permanent.
    assert is_network_timeout(refused, hub=False)  # A reward's own judge server: transient.
