import pytest

from darts_bench.config import Config, ConfigError, load_config


def test_packaged_configs_validate():
    for name in ("tiny", "smollm2-135m", "llama2-7b"):
        cfg = load_config(name)
        assert cfg.name == name


def test_unknown_key_names_key_and_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("surgery:\n  rnak: 8\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(p))
    assert "surgery.rnak: unknown key" in str(e.value)
    assert str(p) in str(e.value)


def test_wrong_type_and_range(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("surgery:\n  rank: -3\ncalibration:\n  n_prompts: lots\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(p))
    msg = str(e.value)
    assert "surgery.rank" in msg and "calibration.n_prompts" in msg


def test_set_override_validated():
    cfg = load_config("tiny", ["surgery.rank=8", "executor=ray"])
    assert cfg.surgery.rank == 8 and cfg.executor == "ray"
    with pytest.raises(ConfigError, match="executor"):
        load_config("tiny", ["executor=slurm"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config("tiny", ["surgery.rank"])
    with pytest.raises(ConfigError, match="surgery.rnak: unknown key"):
        load_config("tiny", ["surgery.rnak=3"])


def test_merge_density_rules():
    with pytest.raises(ConfigError, match="needs density"):
        load_config("tiny", ["merges=[{name: t, method: ties}]"])
    with pytest.raises(ConfigError, match="must be unique"):
        load_config("tiny", ["merges=[{name: t, method: linear}, {name: t, method: linear}]"])


def test_unknown_config_name():
    with pytest.raises(ConfigError, match="unknown config"):
        load_config("tinyy")


def test_yaml_syntax_error(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("surgery: [unclosed\n")
    with pytest.raises(ConfigError, match="YAML syntax error"):
        load_config(str(p))


def test_digest_changes_with_content():
    a, b = Config(), Config(seed=1)
    assert a.digest() != b.digest() and a.digest("pool") == b.digest("pool")


def test_merge_names_checked():
    with pytest.raises(ConfigError, match="reserved"):
        load_config("tiny", ["merges=[{name: base, method: linear}]"])
    with pytest.raises(ConfigError, match="merges.0.name"):
        load_config("tiny", ["merges=[{name: a/b, method: linear}]"])
    with pytest.raises(ConfigError, match="at least one merge"):
        load_config("tiny", ["merges=[]"])


def test_cli_rejects_non_positive_limit(capsys):
    from darts_bench.cli import main

    for bad in ("0", "-3", "x"):
        with pytest.raises(SystemExit):
            main(["run", "--dry-run", "--limit", bad])
        assert "positive integer" in capsys.readouterr().err


def test_empty_config_file_is_an_error(tmp_path):
    """An empty file (or only comments) would silently be the full default run (issue 30)."""
    for text in ("", "# nothing yet\n", "\n\n"):
        p = tmp_path / "empty.yaml"
        p.write_text(text)
        with pytest.raises(ConfigError, match="is empty") as e:
            load_config(str(p))
        assert str(p) in str(e.value) and "--config tiny" in str(e.value)
    p.write_text("{}\n")  # the defaults, asked for explicitly
    assert load_config(str(p)).name == "empty"


def test_directory_as_config_says_so(tmp_path, capsys):
    from darts_bench.cli import main

    with pytest.raises(ConfigError, match="is a directory, not a YAML file") as e:
        load_config(str(tmp_path))
    assert str(tmp_path) in str(e.value) and "tiny" in str(e.value)
    assert main(["run", "--dry-run", "--config", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_allow_unisolated_key_stays_out_of_dumps_and_digests():
    on, off = load_config("tiny", ["allow_unisolated=true"]), load_config("tiny")
    assert on.allow_unisolated is True and off.allow_unisolated is False
    assert "allow_unisolated" not in on.model_dump(mode="json") and on.digest() == off.digest()
    with pytest.raises(ConfigError, match="allow_unisolated"):
        load_config("tiny", ["allow_unisolated=maybe"])


def test_surgery_controls_validated():
    from darts_bench.config import ConfigError, load_config

    cfg = load_config("tiny", ["surgery.controls=[param_matched]"])
    assert cfg.surgery.controls == ["param_matched"]
    assert load_config("micro").surgery.controls == []  # off by default
    with pytest.raises(ConfigError, match="param_matched matches the darts head's parameter count"):
        load_config("tiny", ["surgery.controls=[param_matched]", "surgery.methods=[surgery]"])
    with pytest.raises(ConfigError, match="surgery.controls"):
        load_config("tiny", ["surgery.controls=[bigger]"])
    with pytest.raises(ConfigError, match="repeated entries"):
        load_config("tiny", ["surgery.controls=[param_matched, param_matched]"])
    with pytest.raises(ConfigError, match="sweep.surgery.controls: controls are already rows"):
        load_config("tiny", ['sweep.surgery.controls=[[], ["param_matched"]]'])
