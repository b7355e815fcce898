"""The config-file loader and the example-script arguments (in-process: no ranks, no torchrun)."""

from __future__ import annotations

import re

import pytest

from shardformer.cli import BASE_KEYS, Config, ConfigError, Key, load_config, parse_example_args
from shardformer.cli.example_args import find_config_args, parse_overrides
from shardformer.cli.preflight import LaunchError, check_sizes
from shardformer.core.config import CP_MODES, ENGINE_ZERO_STAGES, PRECISIONS, EngineConfig


def write(tmp_path, text, name="config.py"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_loads_settings_in_either_case_and_fills_defaults(tmp_path):
    path = write(
        tmp_path,
        "import os\n"
        "tensor_parallel_size = 2\nZERO_STAGE = 1\nlr = 1\n"
        "checkpoint_dir = os.path.join(os.path.dirname(__file__), 'ckpt')\n"
        "_private = 'not a setting'\n"
        "def helper():\n    return 3\n",
    )
    cfg = load_config(path)
    assert isinstance(cfg, Config) and cfg.source == path
    assert cfg.tensor_parallel_size == 2 and cfg["zero_stage"] == 1
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)  # an int is accepted for a float key
    assert cfg.checkpoint_dir == str(tmp_path / "ckpt")
    assert cfg.batch_size == BASE_KEYS["batch_size"].default and cfg.data_parallel_size is None
    assert cfg.get("missing", 7) == 7 and "_private" not in cfg and "helper" not in cfg
    with pytest.raises(AttributeError, match="read-only"):
        cfg.lr = 2.0
    with pytest.raises(AttributeError, match="did you mean 'steps'"):
        _ = cfg.stepz
    assert cfg.replace(steps=3).steps == 3 and cfg.steps == BASE_KEYS["steps"].default


def test_engine_keys_take_defaults_and_choices_from_engine_config():
    engine = EngineConfig()
    assert BASE_KEYS["tensor_parallel_size"].default == engine.tp and BASE_KEYS["data_parallel_size"].default is None
    assert BASE_KEYS["seed"].default == engine.seed and BASE_KEYS["max_grad_norm"].type is float
    assert BASE_KEYS["zero_stage"].choices == ENGINE_ZERO_STAGES and BASE_KEYS["precision"].choices == tuple(PRECISIONS)
    assert BASE_KEYS["dp_replicate"].default == engine.dp_replicate == 1


def test_short_size_names_in_the_file_and_on_the_command_line(tmp_path):
    path = write(tmp_path, "tp = 2\n")
    cfg = load_config(path, overrides={"pp": 2, "dp": 1})
    assert (cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.data_parallel_size) == (2, 2, 1)
    with pytest.raises(ConfigError, match="both tp= and tensor_parallel_size= are set"):
        load_config(write(tmp_path, "tp = 2\ntensor_parallel_size = 2\n", "both.py"))


def test_context_parallel_keys(tmp_path):
    """cp / cp_mode (EngineConfig's names) or context_parallel_size / _mode (ShardConfig's), with
    EngineConfig's defaults and choices; the launcher counts cp in the world size."""
    engine = EngineConfig()
    cfg = load_config(write(tmp_path, "tp = 2\n"))
    assert (cfg.context_parallel_size, cfg.context_parallel_mode) == (engine.cp, engine.cp_mode) == (1, "ring")
    assert BASE_KEYS["context_parallel_mode"].choices == CP_MODES
    cfg = load_config(write(tmp_path, "cp = 2\ncp_mode = 'all_to_all'\n", "short.py"))
    assert (cfg.context_parallel_size, cfg.context_parallel_mode) == (2, "all_to_all")
    path = write(tmp_path, "context_parallel_size = 4\ncontext_parallel_mode = 'ring'\n", "long.py")
    cfg = load_config(path, overrides={"cp_mode": "all_to_all"})
    assert (cfg.context_parallel_size, cfg.context_parallel_mode) == (4, "all_to_all")
    assert EngineConfig(cp=cfg.context_parallel_size, cp_mode=cfg.context_parallel_mode).cp == 4
    for text, expected in [
        ("cp_mode = 'zigzag'\n", "context_parallel_mode='zigzag' is not one of 'ring', 'all_to_all'"),
        ("context_parallel_size = 0\n", "context_parallel_size=0 must be at least 1"),
        ("cp = 2.0\n", "context_parallel_size=2.0 has type float, expected int"),
        ("cp = 2\ncontext_parallel_size = 2\n", "both cp= and context_parallel_size= are set; keep one"),
        ("context_paralel_size = 2\n", "did you mean 'context_parallel_size'"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(expected)):
            load_config(write(tmp_path, text, "bad.py"))
    with pytest.raises(ConfigError, match=re.escape("--set: context_parallel_mode='Ring' is not one of")):
        load_config(path, overrides={"cp_mode": "Ring"})
    cfg = load_config(write(tmp_path, "tp = 2\ncp = 2\n", "tp_cp.py"))
    with pytest.raises(LaunchError, match=re.escape("tensor_parallel_size=2 x context_parallel_size=2 x pipeline_")):
        check_sizes(cfg, 1, 2)
    check_sizes(cfg, 1, 4)
    check_sizes(cfg.replace(data_parallel_size=2), 2, 4)  # 2 nodes x 4 = tp 2 x cp 2 x dp 2


def test_unknown_key_names_it_lists_known_and_suggests(tmp_path):
    path = write(tmp_path, "tensr_parallel_size = 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    text = str(err.value)
    assert "unknown key 'tensr_parallel_size'" in text and "did you mean 'tensor_parallel_size'" in text
    assert "known keys:" in text and "zero_stage" in text and path in text


@pytest.mark.parametrize(
    "line, expected",
    [
        ("steps = '10'", r"steps='10' has type str, expected int"),
        ("steps = True", r"steps=True has type bool, expected int"),
        ("lr = 'fast'", r"lr='fast' has type str, expected float"),
        ("precision = 'fp8'", r"precision='fp8' is not one of 'fp32', 'fp16', 'bf16'"),
        ("tensor_parallel_size = 0", r"tensor_parallel_size=0 must be at least 1"),
        ("BATCH_SIZE = 4\nbatch_size = 8", r"'BATCH_SIZE' and 'batch_size' are the same key"),
        ("steps = ", r"could not execute the config file: SyntaxError"),
    ],
)
def test_bad_values_name_key_value_and_expected(tmp_path, line, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(write(tmp_path, line + "\n"))


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file .*nope.py' not found"):
        load_config(tmp_path / "nope.py")


def test_extra_keys_overrides_and_colossal_parallel_dict(tmp_path):
    path = write(tmp_path, "parallel = dict(tensor=dict(size=2, mode='1d'), pipeline=1)\nprompt = 'Hi'\n")
    extra = {"prompt": "Hello", "max_new_tokens": 20, "temperature": Key(float, 1.0, "sampling temperature")}
    cfg = load_config(path, extra, overrides={"max_new_tokens": 5, "STEPS": 2})
    assert (cfg.tensor_parallel_size, cfg.pipeline_parallel_size) == (2, 1)
    assert (cfg.prompt, cfg.max_new_tokens, cfg.temperature, cfg.steps) == ("Hi", 5, 1.0, 2)
    with pytest.raises(ConfigError, match=r"--set: max_new_tokens='many' has type str, expected int"):
        load_config(path, extra, overrides={"max_new_tokens": "many"})
    with pytest.raises(ConfigError, match="unknown key 'prompt'"):
        load_config(path)  # without the script's extra keys, its keys are unknown
    assert load_config(path, allow_unknown=True).prompt == "Hi"  # the launcher's lenient mode
    with pytest.raises(ConfigError, match="parallel has unknown axis 'tensr'"):
        load_config(write(tmp_path, "parallel = dict(tensr=2)\n", "p.py"))
    with pytest.raises(ConfigError, match="would hide Config.get"):
        load_config(path, {"get": 1})


def test_overrides_and_config_args_from_a_command_line():
    assert parse_overrides(["steps=2", "lr=1e-4", "precision=bf16", "model_path=/tmp/m", "seed=None"]) == {
        "steps": 2,
        "lr": 1e-4,
        "precision": "bf16",
        "model_path": "/tmp/m",
        "seed": None,
    }
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_overrides(["steps"])
    args = ["--mode", "train", "--config=c.py", "--set", "steps=3", "--", "--config", "other.py"]
    assert find_config_args(args) == ("c.py", {"steps": 3})
    assert find_config_args(["--mode", "train"]) == (None, {})
    with pytest.raises(ConfigError, match="--config needs a value"):
        find_config_args(["--config"])


def test_parse_example_args(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    path = write(tmp_path, "steps = 4\n")
    cfg, mode = parse_example_args(
        ["--config", path, "--mode", "inference", "--set", "prompt=Hey"], {"prompt": "Hello"}
    )
    assert (cfg.steps, cfg.prompt, mode) == (4, "Hey", "inference")

    for argv, message in [
        (["--config", path, "--mode", "fly"], "argument --mode: invalid choice: 'fly'"),
        (["--mode", "train"], "the following arguments are required: --config"),
        (["--config", str(tmp_path / "nope.py"), "--mode", "train"], "nope.py' not found"),
        (["--config", path, "--mode", "train", "--set", "stepz=1"], "unknown key 'stepz'; did you mean 'steps'"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            parse_example_args(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err

    monkeypatch.setenv("LOCAL_RANK", "1")  # other ranks exit 2 without repeating the message
    with pytest.raises(SystemExit):
        parse_example_args(["--config", path, "--mode", "fly"])
    assert capsys.readouterr().err == ""
