"""A flag that several commands take is declared alike in each: same parameter name, type,
range, default, environment variable and help (docs: `--help` of each command), so that a
copy cannot drift from the others. The few flags that differ on purpose are listed here,
with the reason."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import click
import pytest

from scheduler.cli import cli
from scheduler.liveness import ENV_NAMES, Liveness

SAME_NAME_OTHER_OPTION = {
    "--interval": "poller: seconds between sweeps, a liveness knob (RLFLEET_POLL_INTERVAL); "
    "requeue: seconds between its ticks",
    "--port": "web: the port it listens on; vm add: the VM's SSH port",
    "--host": "web: the address it listens on; vm add: the VM's address",
    "--gpus": "up: GPUs the local VM simulates; job submit: GPUs the job asks for",
    "--entrypoint": "up: the local VM's, checked when the VM is added; vm add: a VM column",
}
"""Flags that name different options in different commands."""

HELP_MAY_DIFFER = {
    "--database-url": "the group's says what it is; a daemon's, that it overrides the group's",
    "--nats-url": "the group's says what it is; a daemon's, that it overrides the group's",
    "--log-level": "the group's default depends on the command; a daemon's is INFO",
    "--json": "a listing prints itself as JSON; job submit prints the new job",
    "--state-dir": "up keeps its data there; web reads its token there",
}
"""Flags declared alike everywhere but whose help says what they mean for the command."""

DAEMONS = {"up", "poller", "dispatcher", "requeue"}


def commands() -> dict[str, click.Command]:
    """Every command of `rlfleet`, the group included, by its path (`rlfleet vm add`)."""
    found: dict[str, click.Command] = {}

    def walk(command: click.Command, path: str) -> None:
        found[path] = command
        if isinstance(command, click.Group):
            ctx = click.Context(command)
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                assert sub is not None
                walk(sub, f"{path} {name}")

    walk(cli, "rlfleet")
    return found


def declaration(option: click.Option) -> dict[str, Any]:
    """Everything the option declares but its help, comparable (the type's own attributes
    too: `to_info_dict` leaves some out, such as a Path's `path_type`)."""
    info = option.to_info_dict()
    info.pop("help")
    info["type_class"] = type(option.type).__qualname__
    info["type_attrs"] = {k: repr(v) for k, v in sorted(vars(option.type).items())}
    info["show_default"] = option.show_default
    return info


def shared_flags(names: set[str] | None = None) -> dict[str, dict[str, click.Option]]:
    """Each long flag taken by more than one command (of `names`, default all): the option
    of each command that takes it."""
    by_flag: dict[str, dict[str, click.Option]] = defaultdict(dict)
    for path, command in commands().items():
        if names is not None and path.split()[-1] not in names:
            continue
        for param in command.params:
            if isinstance(param, click.Option):
                flag = next(o for o in param.opts if o.startswith("--"))
                by_flag[flag][path] = param
    return {flag: found for flag, found in by_flag.items() if len(found) > 1}


def test_a_flag_that_several_commands_take_is_declared_alike() -> None:
    """Every flag shared by commands of `rlfleet` has one declaration (name, type, range,
    default, env var) and one help, save the flags listed above."""
    for flag, options in shared_flags().items():
        if flag in SAME_NAME_OTHER_OPTION:
            continue
        declarations = {path: declaration(o) for path, o in options.items()}
        first = next(iter(declarations.values()))
        assert all(d == first for d in declarations.values()), (flag, declarations)
        if flag not in HELP_MAY_DIFFER:
            helps = {path: o.help for path, o in options.items()}
            assert len(set(helps.values())) == 1, (flag, helps)


def test_the_daemon_commands_describe_a_shared_flag_the_same_way() -> None:
    """Among `up`, `poller`, `dispatcher` and `requeue`, a flag they share is the same
    option with the same help, even those whose help differs from the group's."""
    shared = shared_flags(DAEMONS)
    assert {"--fence-after", "--fence-grace", "--database-url", "--metrics-port"} <= set(shared)
    for flag, options in shared.items():
        if flag in SAME_NAME_OTHER_OPTION:
            continue
        described = {path: (declaration(o), o.help) for path, o in options.items()}
        first = next(iter(described.values()))
        assert all(d == first for d in described.values()), (flag, described)


@pytest.mark.parametrize("listed", [SAME_NAME_OTHER_OPTION, HELP_MAY_DIFFER])
def test_the_listed_exceptions_are_still_shared(listed: dict[str, str]) -> None:
    """Each flag allowed to differ is still taken by several commands (the list holds no
    stale entry that would let a new copy differ unnoticed)."""
    assert set(listed) <= set(shared_flags())


def test_a_liveness_flag_has_its_knobs_default_and_names_its_variable() -> None:
    """A flag that reads a liveness knob's environment variable defaults to the knob's
    default (scheduler/liveness.py) and its help names the variable."""
    knob_of = {env: knob for knob, env in ENV_NAMES.items()}
    seen = set()
    for command in commands().values():
        for param in command.params:
            env = param.envvar if isinstance(param, click.Option) else None
            if isinstance(env, str) and env in knob_of:
                seen.add(env)
                assert param.default == getattr(Liveness, knob_of[env]), param.opts
                assert (param.help or "").endswith(f"(env {env})."), param.opts
    assert seen == set(ENV_NAMES.values())
