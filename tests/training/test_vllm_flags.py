"""vLLM flags: parsed, checked, handed to TRL's GRPOConfig; --use_vllm without vllm is exit 64."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from training.args import parse_args
from training.trainer import build_config, node_count

BASE = ["--model", "m", "--dataset", "d.jsonl", "--reward_function", "correctness"]


def test_server_mode_flags_reach_grpo_config(tmp_path: Path):
    args = parse_args(
        [*BASE, "--output_dir", str(tmp_path), "--use_vllm", "--vllm_mode", "server",
         "--vllm_server_host", "10.1.2.3", "--vllm_server_port", "8011",
         "--vllm_group_port", "51299", "--vllm_server_timeout", "12"]
    )  # fmt: skip
    config = build_config(args)
    assert (config.use_vllm, config.vllm_mode) == (True, "server")
    assert (config.vllm_server_host, config.vllm_server_port) == ("10.1.2.3", 8011)
    assert (config.vllm_group_port, config.vllm_server_timeout) == (51299, 12.0)
    assert config.vllm_server_base_url is None


def test_a_base_url_reaches_grpo_config(tmp_path: Path):
    url = "http://vllm-0.internal:8000"
    args = parse_args([*BASE, "--output_dir", str(tmp_path), "--vllm_server_base_url", url])
    assert build_config(args).vllm_server_base_url == url


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--vllm_server_port", "0"], "--vllm_server_port must be a port number"),
        (["--vllm_group_port", "70000"], "--vllm_group_port must be a port number"),
        (["--vllm_server_host", "h/x?y"], "--vllm_server_host: not a host name or address"),
        (["--vllm_server_host", "h\n"], "--vllm_server_host: not a host name or address"),
        (["--vllm_server_base_url", "file:///etc"], "--vllm_server_base_url: expected http"),
        (["--vllm_server_base_url", "http://u:p@h:1"], "--vllm_server_base_url: expected http"),
        (["--vllm_server_timeout", "0"], "--vllm_server_timeout must be more than 0"),
        (["--vllm_mode", "remote"], "invalid choice: 'remote'"),
    ],
)
def test_bad_vllm_flags_exit_64_with_one_line(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
):
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*BASE, *flags])
    assert exit_info.value.code == 64
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_use_vllm_without_vllm_exits_64_before_loading_anything(tmp_path: Path):
    from tests.training.helpers import train_grpo

    result = train_grpo(*BASE, "--use_vllm", "--vllm_mode", "server", cwd=tmp_path)
    assert result.returncode == 64
    assert (
        result.stderr == "train-grpo: error: --use_vllm: vllm is not installed (pip install vllm)\n"
    )


@pytest.mark.parametrize(
    ("env", "nodes"),
    [
        ({}, 1),
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, 1),
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, 2),
        ({"WORLD_SIZE": "x", "LOCAL_WORLD_SIZE": "4"}, 1),
    ],
)
def test_node_count_comes_from_torchrun_s_environment(
    env: dict[str, str], nodes: int, monkeypatch: pytest.MonkeyPatch
):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert node_count() == nodes
