"""``hflow-async show-config --describe``: every config key with its one-line description."""

from __future__ import annotations

import yaml

from controller.cli import main
from controller.config import load_config
from controller.config_docs import KEY_DOCS, config_keys, to_described_yaml


def test_every_config_key_has_one_line_and_every_line_a_key():
    keys = config_keys()
    assert len(keys) > 100 and "algorithm.max_staleness" in keys and "model.tiny.seed" in keys
    assert [k for k in keys if k not in KEY_DOCS] == []       # a new key needs its line in KEY_DOCS
    assert [k for k in KEY_DOCS if k not in keys] == []       # no line for a key that is gone
    for key, doc in KEY_DOCS.items():
        assert doc and "\n" not in doc and len(doc) <= 110, key


def test_show_config_describe_prints_each_key_with_its_description(capsys, tmp_path):
    assert main(["show-config", "--describe", "--preset", "tiny", "algorithm.max_staleness=2"]) == 0
    out = capsys.readouterr().out
    assert f"  max_staleness: 2  # {KEY_DOCS['algorithm.max_staleness']}\n" in out
    assert f"  'n': 8  # {KEY_DOCS['rollout.n']}\n" in out
    assert f"    seed: 0  # {KEY_DOCS['model.tiny.seed']}\n" in out  # nested sections by their full key
    described = [line for line in out.splitlines() if "  # " in line]
    assert len(described) == len(config_keys())
    # Still YAML: the same tree as plain show-config, and usable as --config.
    cfg = load_config(preset="tiny", overrides=["algorithm.max_staleness=2", "run_dir=x"])
    assert yaml.safe_load(to_described_yaml(cfg)) == yaml.safe_load(main_output(["show-config", "--preset", "tiny",
                                                                                 "algorithm.max_staleness=2",
                                                                                 "run_dir=x"], capsys))
    path = tmp_path / "described.yaml"
    path.write_text(to_described_yaml(cfg))
    assert load_config(config_file=str(path)) == cfg


def test_describe_leaves_dict_values_alone():
    cfg = load_config(overrides=["run_dir=x"])  # the default preset sets data.task_kwargs
    lines = to_described_yaml(cfg).splitlines()
    kwargs = lines.index(next(line for line in lines if line.startswith("  task_kwargs:")))
    assert lines[kwargs + 1].startswith("    min_terms: ") and "#" not in lines[kwargs + 1]


def main_output(argv, capsys) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out
