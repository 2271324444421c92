"""TRL's whole configuration on train_grpo.py's command line and in recipe files: every field
of the installed TRL's classes is accepted under its own name, bad flags, keys, types and
combinations exit 64 with one line before anything is loaded, and `--help` stays fast."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.training.helpers import REPO, _env, train_grpo
from training.args import ALIASES, OWN_FIELDS, parse_args
from trlspec.schema import SHIPPED, fields_by_name, live_schema

BASE = ["--model", "m", "--dataset", "d.jsonl", "--reward_function", "a"]


def _installed_fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _sample(f: dataclasses.Field[Any], hint: Any) -> str:
    """A command-line value of the field's type, different from its default where easy."""
    if f.default is not dataclasses.MISSING and f.default is not None:
        default = f.default
        value = getattr(default, "value", default)  # an enum member
        if isinstance(value, bool):
            return "false" if value else "true"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, str) and value:
            return value
        if isinstance(value, dict):
            return json.dumps(value)
    for member in typing.get_args(hint) or (hint,):
        if typing.get_origin(member) is typing.Literal:
            return str(typing.get_args(member)[0])
    if f.metadata.get("choices"):
        return str(f.metadata["choices"][0])
    text = str(hint)
    if "dict" in text:
        return "{}"
    if "bool" in text:
        return "true"
    if "int" in text:
        return "3"
    if "float" in text:
        return "0.5"
    return "x"


SAMPLES = {"vllm_server_base_url": "http://trainer:8000"}
"""Values whose type alone does not make one train_grpo.py's own checks accept."""


def _cases(cls: type) -> list[tuple[str, str]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, SAMPLES.get(f.name) or _sample(f, hints[f.name]))
            for f in _installed_fields(cls)]  # fmt: skip


@pytest.mark.slow  # imports trl (seconds)
def test_the_shipped_schema_is_the_installed_trls():
    # The flags come from TRL's dataclasses; the shipped copy (read by --help) must be what
    # they give now. On failure: python -m trlspec.schema --write
    shipped = json.loads(SHIPPED.read_text())
    assert shipped == json.loads(json.dumps(live_schema())), "run make trl-schema"


@pytest.mark.slow  # imports trl (seconds)
def test_every_grpo_and_model_config_field_is_accepted_under_its_own_name():
    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig

    names = {f.name for cls in (GRPOConfig, ModelConfig, DatasetMixtureConfig)
             for f in _installed_fields(cls)}  # fmt: skip
    assert len(names) > 200  # GRPOConfig alone has 191 fields in TRL 1.16
    assert names <= set(fields_by_name())
    checked, refused = 0, []
    for cls in (GRPOConfig, ModelConfig):
        for name, value in _cases(cls):
            if name in ("model_name_or_path", "output_dir"):
                continue  # rlfleet's own flags (--model, --output_dir); tested apart.
            extra = ["--num_train_epochs", "1"] if name == "max_steps" else []
            try:
                args = parse_args([*BASE, *extra, f"--{name}", value])
            except SystemExit:
                refused.append(f"--{name} {value}")
                continue
            own = ALIASES.get(name, name)  # resume_from_checkpoint is --resume
            assert own in args.given, name
            got = getattr(args, own) if own in OWN_FIELDS else args.trl[name]
            assert got is not None or value in ("none", "None"), name
            checked += 1
    assert refused == []
    assert checked >= len(names) - 5


@pytest.mark.slow  # imports trl (seconds)
def test_a_recipe_may_hold_every_grpo_config_field_at_its_default(tmp_path: Path):
    from trl import GRPOConfig

    recipe: dict[str, Any] = {"model_name_or_path": "m", "dataset_name": "d.jsonl",
                              "reward_funcs": ["a"]}  # fmt: skip
    for f in _installed_fields(GRPOConfig):
        if f.default is not dataclasses.MISSING:
            value = getattr(f.default, "value", f.default)
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            continue
        try:
            json.dumps(value)
        except TypeError:
            continue
        recipe[f.name] = value
    recipe["max_steps"] = 5
    path = tmp_path / "all.yaml"
    path.write_text(yaml.safe_dump(recipe))
    args = parse_args(["--config", str(path)])
    assert args.model == "m" and args.max_steps == 5
    assert args.trl["loss_type"] == GRPOConfig.__dataclass_fields__["loss_type"].default


def test_trl_spellings_of_rlfleets_flags(tmp_path: Path):
    args = parse_args(
        ["--model_name_or_path", "m", "--dataset_name", "d", "--dataset_train_split", "tr",
         "--reward_funcs", "accuracy_reward", "my_lib.rewards.fn", "--resume_from_checkpoint",
         "true"]
    )  # fmt: skip
    assert (args.model, args.dataset, args.dataset_split) == ("m", "d", "tr")
    assert args.reward_function == ["accuracy_reward", "my_lib.rewards.fn"]
    assert args.resume == "auto"


def test_the_command_line_overrides_the_recipe(tmp_path: Path):
    path = tmp_path / "r.yaml"
    path.write_text(
        "model_name_or_path: from-file\ndataset_name: d.jsonl\nreward_funcs: [a]\n"
        "learning_rate: 1.0e-05\nloss_type: dr_grpo\nlr_scheduler_type: cosine\nseed: 3\n"
        "env:\n  SOME_VAR: '1'\n"
    )
    args = parse_args(["--config", str(path), "--seed", "7", "--model", "from-cli",
                       "--lr_scheduler_type", "constant"])  # fmt: skip
    assert args.model == "from-cli" and args.seed == 7 and args.learning_rate == 1e-5
    assert args.trl["loss_type"] == "dr_grpo" and args.trl["lr_scheduler_type"] == "constant"
    assert args.env == {"SOME_VAR": "1"}


@pytest.mark.parametrize(
    ("argv", "recipe", "message"),
    [
        (["--loss_typo", "x"], None, "unrecognized arguments: --loss_typo"),
        (["--num_iterations", "two"], None, "--num-iterations: expected int, got 'two'"),
        (["--lr_scheduler_type", "wavy"], None, "'wavy' is not one of linear, cosine"),
        ([], "loss_typo: dr_grpo\n", "unknown key 'loss_typo' (did you mean loss_type?)"),
        ([], "num_iterations: two\n", "key num_iterations: expected int, got 'two'"),
        ([], "gradient_checkpointing: maybe\n", "key gradient_checkpointing: expected true/false"),
        ([], "keywords: {a: 1}\n", "key keywords: expected a list of values"),
        ([], "- a\n- b\n", "expected a mapping of field names to values"),
        ([], "a: [\n", "not valid YAML"),
        ([], "dataset_streaming: true\n", "dataset_streaming: streaming datasets are not"),
        (["--model_name_or_path", "n"], None, "give --model or model_name_or_path, not both"),
        (["--max_steps", "0"], None, "--max_steps must be at least 1"),
    ],
)
def test_bad_flags_keys_and_values_exit_64_with_one_line(
    argv: list[str], recipe: str | None, message: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
):  # fmt: skip
    if recipe is not None:
        (tmp_path / "r.yaml").write_text(recipe)
        argv = [*argv, "--config", str(tmp_path / "r.yaml")]
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*BASE, *argv])
    assert exit_info.value.code == 64
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1


def test_a_missing_recipe_exits_64(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*BASE, "--config", str(tmp_path / "none.yaml")])
    assert exit_info.value.code == 64
    assert "cannot read it" in capsys.readouterr().err


def test_help_is_fast_lists_rlfleets_flags_first_and_imports_no_torch():
    code = (
        "import sys, time; t = time.monotonic()\n"
        "from training.train_grpo import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('ELAPSED', time.monotonic() - t, 'torch' in sys.modules, 'trl' in sys.modules)"
    )
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(None),
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    wall = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    *help_lines, last = result.stdout.strip().splitlines()
    _, elapsed, torch_loaded, trl_loaded = last.split()
    assert (torch_loaded, trl_loaded) == ("False", "False")
    assert float(elapsed) < 1.0, elapsed
    text = "\n".join(help_lines)
    assert text.index("--reward_function") < text.index("TRL GRPOConfig")
    assert text.index("TRL GRPOConfig") < text.index("--loss_type") < text.index("TRL ModelConfig")
    assert text.index("TRL ModelConfig") < text.index("--lora_target_modules")
    assert wall < 30  # the interpreter's own start on a busy machine included


@pytest.mark.slow
@pytest.mark.parametrize(
    ("recipe", "env", "message"),
    [
        ("bf16: true\n", {}, "bf16: needs a CUDA GPU"),
        ("push_to_hub: true\n", {"HF_HUB_OFFLINE": "1"}, "push_to_hub: the hub is offline here"),
        ("hub_model_id: me/model\n", {"HF_HUB_OFFLINE": "1"}, "hub_model_id: the hub is offline"),
        # Not installed here; where it is, the missing key is what is named.
        ("report_to: wandb\n", {"WANDB_API_KEY": "", "WANDB_MODE": ""}, "report_to wandb: "),
        ("use_vllm: true\n", {}, "--use_vllm: vllm is not installed"),
        ("generation_batch_size: 16\nsteps_per_generation: 2\n", {}, "steps_per_generation"),
    ],
)
def test_what_the_machine_lacks_exits_64_before_loading(
    recipe: str, env: dict[str, str], message: str, tmp_path: Path
):
    (tmp_path / "r.yaml").write_text(recipe)
    # Neither model nor dataset exists: the check must come before either is looked at.
    argv = ["--model", str(tmp_path / "no-model"), "--dataset", str(tmp_path / "no.jsonl"),
            "--reward_function", "soft_format", "--config", str(tmp_path / "r.yaml"),
            "--output_dir", str(tmp_path / "out")]  # fmt: skip
    result = train_grpo(*argv, env=env)
    assert result.returncode == 64, result.stderr[-2000:]
    err = result.stderr.strip()
    assert message in err
    assert len(err.splitlines()) == 1, err


def test_a_recipes_resume_from_checkpoint_true_is_resume_auto(tmp_path: Path):
    (tmp_path / "r.yaml").write_text("resume_from_checkpoint: true\n")
    assert parse_args([*BASE, "--config", str(tmp_path / "r.yaml")]).resume == "auto"


@pytest.mark.slow
def test_push_to_hub_without_a_token_exits_64_naming_the_way_out(tmp_path: Path):
    (tmp_path / "r.yaml").write_text("push_to_hub: true\n")
    argv = ["--model", str(tmp_path / "no-model"), "--dataset", str(tmp_path / "no.jsonl"),
            "--reward_function", "soft_format", "--config", str(tmp_path / "r.yaml")]  # fmt: skip
    env = {"HF_HUB_OFFLINE": "0", "HF_TOKEN": "", "HF_HOME": str(tmp_path / "hf")}
    result = train_grpo(*argv, env=env)
    assert result.returncode == 64, result.stderr[-2000:]
    assert result.stderr.strip() == (
        "train-grpo: error: push_to_hub: no hub token here; set HF_TOKEN in the job's "
        "environment (rlfleet job submit --env HF_TOKEN) or leave push_to_hub out"
    )
