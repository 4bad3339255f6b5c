"""``hflow-async show-config --describe``: every config key with its one-line description."""

from __future__ import annotations

import dataclasses

import yaml

from common.settings import doc_of
from controller.cli import main
from controller.config import load_config
from controller.config_docs import config_fields, config_keys, key_docs, to_described_yaml
from trainers.policy_losses import POLICY_LOSSES

KEY_DOCS = key_docs()


def test_every_config_key_declares_its_one_line_description():
    fields = config_fields()
    assert len(fields) > 100 and "algorithm.max_staleness" in fields and "model.tiny.seed" in fields
    for key, f in fields.items():  # a new key needs setting(..., doc="...")
        assert doc_of(f) and "\n" not in doc_of(f) and len(doc_of(f)) <= 110, key


def test_every_policy_loss_config_declares_its_descriptions():
    for name in POLICY_LOSSES:  # each registered loss's own settings, nested under algorithm.policy_loss
        for f in dataclasses.fields(POLICY_LOSSES.config(name)):
            assert doc_of(f) and "\n" not in doc_of(f) and len(doc_of(f)) <= 110, (name, f.name)


def test_describe_shows_the_chosen_policy_losss_own_settings(capsys):
    assert main(["show-config", "--describe", "--preset", "tiny", "algorithm.policy_loss.name=sapo"]) == 0
    out = capsys.readouterr().out
    assert "  policy_loss:\n    name: sapo  # policy loss: " in out
    assert "    tau_pos: 1.0  # sapo: gate temperature for positive advantages [> 0]\n" in out
    assert "dual_clip_c" not in out


def test_a_described_key_says_what_it_accepts():
    assert KEY_DOCS["rollout.n"].endswith(" [>= 1]")
    assert KEY_DOCS["rollers.sglang_mem_fraction"].endswith(" [in (0, 1]]")
    assert KEY_DOCS["trainer.lr_schedule"].endswith(" [one of ['constant', 'cosine']]")
    assert "[" not in KEY_DOCS["data.task"]  # a free string: no bounds, no choices


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
