"""The tests that need sshd or systemd-analyze skip where it is missing, but fail under CI."""

from __future__ import annotations

import pytest

from tests.requires import find_program, require_program


def test_an_installed_program_is_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    assert require_program("/usr/sbin/sshd", "sshd", "openssh-server") == "/usr/sbin/sshd"


@pytest.mark.parametrize("ci", ["true", "TRUE", "1"])
def test_a_missing_program_fails_under_ci(monkeypatch: pytest.MonkeyPatch, ci: str) -> None:
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception, match="sshd is not installed"):
        require_program(None, "sshd", "openssh-server")


@pytest.mark.parametrize("ci", [None, "", "false", "0"])
def test_a_missing_program_is_skipped_elsewhere(
    monkeypatch: pytest.MonkeyPatch, ci: str | None
) -> None:
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception, match="apt-get install openssh-server"):
        require_program(None, "sshd", "openssh-server")


def test_find_program_looks_beyond_path(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    program = tmp_path / "sshd"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_program("sshd") is None
    assert find_program("sshd", str(tmp_path / "nothing"), str(program)) == str(program)
