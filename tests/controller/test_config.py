import re

import pytest

from controller.cli import main
from controller.config import HFlowConfig, available_presets, load_config, to_yaml


def test_presets_ship_and_load():
    assert {"tiny", "smollm2-reasoning"} <= set(available_presets())
    assert load_config(preset="tiny").model.path == "tiny"
    default = load_config()
    assert default.model.path == "smollm2-135m-instruct"  # embedded default
    # make run shows a held-out curve: validation before the first step, in between and at the end
    assert default.data.val_size >= 32 and 0 < default.trainer.val_every < default.trainer.total_steps


def test_override_and_mode():
    cfg = load_config(mode="fully-async", overrides=["rollout.n=8", "trainer.total_steps=20", "run_dir=/tmp/x"])
    assert isinstance(cfg, HFlowConfig)
    assert (cfg.mode, cfg.rollout.n, cfg.trainer.total_steps, cfg.run_dir) == ("fully-async", 8, 20, "/tmp/x")


@pytest.mark.parametrize(
    "override, needle",
    [
        ("rollout.nn=8", "rollout.nn"),
        ("nosuch=1", "nosuch"),
        ("rollout.n=abc", "rollout.n"),
        ("rollout.n=0", "rollout.n"),
        ("algorithm.adv_estimator=foo", "grpo"),
        ("checkpointengine.backend=pigeon", "shm"),
        ("model.path=/does/not/exist", "model.path"),
        ("rollout.n", "key.subkey=value"),
        ("ray.address=nohost", "ray.address"),
        ("data.answer_key=solution", "data.answer_key"),
        ("trainer.max_grad_norm=nan", "trainer.max_grad_norm"),
        ("trainer.lr=inf", "trainer.lr"),
        ("trainer.ppo_max_token_len_per_gpu=-1", "trainer.ppo_max_token_len_per_gpu must be >= 0, got -1"),
        ("trainer.betas=[0.9,nan]", "trainer.betas"),
        ("trainer.betas=[2,3]", "trainer.betas"),
        ("checkpointengine.timeout_s=nan", "checkpointengine.timeout_s"),
        ("rollout.reward_timeout_s=nan", "rollout.reward_timeout_s"),
        ("algorithm.clip_ratio_low=5", "algorithm.clip_ratio_low"),
        ("trainer=1", "override 'trainer=1'"),
        ("trainer.betas=[0.9]", "trainer.betas"),
        ("data.task=x.jsonl data.task_kwargs={min_terms:2}", "data.task_kwargs"),
        ("ray.address=127.0.0.1:99999", "ray.address"),
        ("ray.connect_timeout_s=nan", "ray.connect_timeout_s"),
        ("ray.connect_timeout_s=0", "ray.connect_timeout_s"),
        ("trainer.host=localhost", "trainer.host"),
        ("transferqueue.host=0.0.0.0", "transferqueue.host"),
        ("checkpointengine.host=nodes", "checkpointengine.host"),
        ("metrics.host=node", "metrics.host"),
        # a list where a mapping goes, or back (OmegaConf raised a bare TypeError, or named key '?')
        ("rollout.env_kwargs=[1,2]", "'rollout.env_kwargs' (from override 'rollout.env_kwargs=[1,2]'): it takes a "
                                     "mapping, not a list"),
        ("rollers.resources=[1]", "'rollers.resources'"),
        ("trainer.betas={a:1}", "'trainer.betas' (from override 'trainer.betas={a:1}'): it takes a list, not a mapping"),
        ("rollers.fault_injection={a:1}", "'rollers.fault_injection'"),
        ("model.tiny=[1]", "'model.tiny'"),
        ("rollout=5", "'rollout' (from override 'rollout=5'): it takes a mapping, not a single value"),
    ],
)
def test_bad_overrides_name_the_key(override, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        load_config(overrides=override.split(" "))


def test_a_config_file_of_the_wrong_shape_names_the_key(tmp_path):
    (tmp_path / "bad.yaml").write_text("rollout:\n  env_kwargs: [1, 2]\n")
    with pytest.raises(ValueError, match=r"'rollout\.env_kwargs' \(from .*bad\.yaml\): it takes a mapping, not a list"):
        load_config(config_file=str(tmp_path / "bad.yaml"))


def test_cross_field_validation():
    with pytest.raises(ValueError, match="max_staleness"):
        load_config(overrides=["algorithm.trigger_sync_steps=3", "algorithm.max_staleness=1"])
    with pytest.raises(ValueError, match="ppo_mini_batch_size"):
        load_config(overrides=["trainer.ppo_mini_batch_size=99"])


def test_dapo_knobs_checked_against_the_rollout(capsys):
    with pytest.raises(ValueError, match=r"algorithm\.overlong_buffer_len=5 exceeds rollout\.max_response_length=4"):
        load_config(preset="tiny", overrides=["algorithm.overlong_buffer_len=5"])
    assert load_config(preset="tiny", overrides=["algorithm.overlong_buffer_len=4"]).algorithm.overlong_buffer_len == 4
    assert main(["show-config", "--preset", "tiny", "algorithm.overlong_buffer_len=5"]) == 2  # exit 2 naming the key
    assert "algorithm.overlong_buffer_len" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"algorithm\.dynamic_sampling=true needs rollout\.n >= 2"):
        load_config(preset="tiny", overrides=["algorithm.dynamic_sampling=true", "rollout.n=1"])


def test_unknown_preset_and_file(tmp_path):
    with pytest.raises(ValueError, match="available presets"):
        load_config(preset="nope")
    with pytest.raises(ValueError, match="does not exist"):
        load_config(config_file=str(tmp_path / "missing.yaml"))
    good = tmp_path / "c.yaml"
    good.write_text("rollout:\n  n: 3\n")
    assert load_config(config_file=str(good)).rollout.n == 3
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  nn: 3\n")
    with pytest.raises(ValueError, match=r"rollout\.nn"):
        load_config(config_file=str(bad))


def test_cli_show_config(capsys):
    assert main(["show-config", "--mode", "fully-async", "rollout.n=8"]) == 0
    out = capsys.readouterr().out
    assert "mode: fully-async" in out
    rollout = out.split("\nrollout:\n", 1)[1]
    assert "'n': 8" in rollout.split("\n", 1)[0]  # YAML quotes the key n (a YAML 1.1 boolean)


def test_cli_rejects_unknown_key(capsys):
    assert main(["show-config", "rollout.nn=8"]) == 2
    assert "rollout.nn" in capsys.readouterr().err


def test_cli_help_lists_modes(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for mode in ("sync", "one-step-off", "fully-async", "show-config"):
        assert mode in out
    assert "'run' (the default" in " ".join(out.split())  # the command that runs a job is listed too
    assert "[run | show-config]" in out


def test_cli_refuses_mode_given_twice_differently(capsys):
    assert main(["show-config", "--mode", "sync", "mode=fully-async"]) == 2
    err = capsys.readouterr().err
    assert "--mode sync conflicts with the override mode=fully-async" in err
    assert main(["show-config", "--mode", "sync", "mode=sync"]) == 0  # the same mode twice is no conflict
    assert "mode: sync" in capsys.readouterr().out
    assert main(["--describe", "trainer.total_steps=1"]) == 2  # --describe goes with show-config only
    assert "--describe goes with show-config" in capsys.readouterr().err


def test_yaml_roundtrip(tmp_path):
    cfg = load_config(preset="tiny", overrides=["rollout.n=5"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    again = load_config(config_file=str(path))
    assert again == cfg


def test_malformed_config_files_are_config_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  n: [\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(config_file=str(bad))
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="must hold a mapping"):
        load_config(config_file=str(listed))


def test_no_root_seed_key():
    # The seeds that act are data.seed, rollout.seed and model.tiny.seed; a root `seed` did nothing.
    with pytest.raises(ValueError, match="seed"):
        load_config(overrides=["seed=3"])


def test_cli_export_after_flags_says_where_it_goes(capsys):
    assert main(["--preset", "tiny", "export", "runs/x"]) == 2
    assert "comes first: hflow-async export RUN_DIR" in capsys.readouterr().err


def test_pool_resources_place_each_pool_and_reject_what_ray_owns():
    cfg = load_config(preset="tiny", overrides=["rollers.resources={hflow_roller: 1}",
                                                "trainer.resources={hflow_trainer: 0.5}"])
    assert cfg.rollers.resources == {"hflow_roller": 1.0} and cfg.trainer.resources == {"hflow_trainer": 0.5}
    assert load_config(preset="tiny").rollers.resources == {}  # default: anywhere
    for bad, needle in [("rollers.resources={GPU: 1}", "rollers.resources: resource name 'GPU'"),
                        ("trainer.resources={node:10.0.0.1: 1}", "trainer.resources: resource name 'node:10.0.0.1'"),
                        ("trainer.resources={hflow_trainer: 0}", "trainer.resources.hflow_trainer=0.0 must be"),
                        ("rollers.resources={hflow_roller: -1}", "rollers.resources.hflow_roller=-1.0 must be")]:
        with pytest.raises(ValueError, match=needle.replace(".", r"\.").replace("{", r"\{")):
            load_config(preset="tiny", overrides=[bad])


@pytest.mark.parametrize("native", [True, False])
def test_auto_compute_dtype_is_decided_once_and_a_resume_keeps_it(monkeypatch, tmp_path, native):
    """model.compute_dtype=auto (the default) is pinned when the config tree is built, after every merge (the
    final model.path and trainer.device); what the run records (config.yaml, which a resume reads) is a dtype,
    kept on a machine that would choose otherwise."""
    from common import models

    monkeypatch.setattr(models, "native_bf16", lambda device: native)
    cfg = load_config()
    chosen = "bfloat16" if native else "float32"
    assert (cfg.model.compute_dtype, cfg.model.dtype) == (chosen, "float32")
    assert f"compute_dtype: {chosen}" in to_yaml(cfg)
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    monkeypatch.setattr(models, "native_bf16", lambda device: not native)
    assert load_config(config_file=str(path)).model.compute_dtype == chosen
    assert load_config(overrides=["model.compute_dtype=float32"]).model.compute_dtype == "float32"
    with pytest.raises(ValueError, match="model.compute_dtype='bf16'.*auto"):
        load_config(overrides=["model.compute_dtype=bf16"])


def test_auto_compute_dtype_follows_the_final_model_and_the_trainer_device(monkeypatch):
    """The tiny preset keeps float32 on a bf16 machine (the default model's choice must not leak through the
    config tree's defaults), and trainer.device decides which device is asked."""
    from common import models

    devices = []
    monkeypatch.setattr(models, "native_bf16", lambda device: devices.append(device) or device == "cpu")
    assert load_config(preset="tiny").model.compute_dtype == "float32"
    assert load_config(preset="tiny", overrides=["model.path=smollm2-135m-instruct"]).model.compute_dtype == "bfloat16"
    assert load_config(overrides=["trainer.device=cuda"]).model.compute_dtype == "float32"
    assert load_config(overrides=["trainer.device=cpu"]).model.compute_dtype == "bfloat16"
    assert devices[-2:] == ["cuda", "cpu"]


def test_a_max_samples_below_what_admission_holds_is_a_config_error():
    """An explicit transferqueue.max_samples below the samples the run's admission can hold in the index at
    once is refused when the config loads (exit 2 before Ray starts), naming the key and the least value: a
    batch of 4096 prompts of 16 samples, staleness 1, 64 held-out prompts need 139648."""
    big = ["data.train_batch_size=4096", "rollout.n=16", "trainer.ppo_mini_batch_size=16", "data.val_size=64"]
    with pytest.raises(ValueError, match=r"transferqueue.max_samples=131072 is below the 139648 samples.*>= 139648"):
        load_config(overrides=[*big, "transferqueue.max_samples=131072"])
    assert load_config(overrides=[*big, "transferqueue.max_samples=139648"]).transferqueue.max_samples == 139648


def test_an_estimator_asking_the_rollers_for_a_field_they_cannot_put_is_a_config_error(monkeypatch):
    from trainers.advantages import ADV_ESTIMATORS, AdvantageEstimator

    grpo = ADV_ESTIMATORS.get("grpo")
    monkeypatch.setitem(ADV_ESTIMATORS._items, "needs_magic",
                        AdvantageEstimator("needs_magic", grpo.fn, roller_extras=("magic",)))
    with pytest.raises(ValueError, match=r"algorithm.adv_estimator='needs_magic' asks the rollers for \['magic'\]"):
        load_config(preset="tiny", overrides=["algorithm.adv_estimator=needs_magic"])


def test_with_defaults_fills_a_plugin_node_by_the_config_class_its_name_chooses():
    from controller.config import to_dict, with_defaults

    tree = to_dict(load_config(preset="tiny", overrides=["algorithm.policy_loss.name=sapo"]))
    del tree["algorithm"]["policy_loss"]["tau_neg"]  # a tree saved before the key existed
    filled = with_defaults(tree)["algorithm"]["policy_loss"]
    assert filled == {"name": "sapo", "tau_pos": 1.0, "tau_neg": 1.05}  # sapo's defaults, not vanilla's
