"""The config tree: each package's section composed into one typed root, plus presets and overrides.

``load_config(mode, preset, config_file, overrides)`` resolves, in order: dataclass defaults → preset
YAML (shipped in ``controller/presets``) or a user YAML file → dotted ``a.b=c`` overrides → ``--mode``.
Unknown keys and bad values raise ``ValueError`` naming the key and what would be accepted.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from checkpointengine.config import CheckpointEngineConfig
from common.models import AUTO_DTYPE, ModelConfig
from common.net import NODE_HOST
from common.registry import Registry
from common.settings import check_settings, setting
from controller.layout import index_samples, sample_fields
from controller.schedules import SCHEDULES
from rollers.config import RollersConfig, RolloutConfig
from trainers.config import MOVED_KEYS, AlgorithmConfig, TrainerConfig
from trainers.policy_losses import POLICY_LOSS_KEY, POLICY_LOSSES
from trainers.rollout_corr import resolve_bypass_mode
from transferqueue.config import TransferQueueConfig

PRESET_DIR = Path(__file__).parent / "presets"
DEFAULT_PRESET = "smollm2-reasoning"
WANDB_MODES = ("offline", "online")
# The plug-in nodes of the tree: each holds ``name`` and the settings of the plug-in it names, declared by the
# config class that plug-in registered with its registry.
PLUGIN_NODES: tuple[tuple[str, Registry], ...] = ((POLICY_LOSS_KEY, POLICY_LOSSES),)


@dataclass
class DataConfig:
    """Prompts. ``task``: a registered task (``tiny_repeat``, synthetic, for the tiny model), a task plug-in
    ``module:name``, a reasoning-gym task name (e.g. ``chain_sum``), or a path to a ``.jsonl``/``.parquet``
    file with ``prompt_key`` and ``answer_key`` columns (``controller.tasks``; checked against the registry
    when the job starts, before any pool). ``size``: examples generated for a procedural task (files use all rows).
    ``train_batch_size`` in prompts per training step; ``max_prompt_length`` in tokens (longer prompts
    raise, naming the row, unless ``skip_long_prompts``). ``val_size``: held-out prompts evaluated during
    training (0 = no validation), held out by text (``val_disjoint``): drawn from the rows after the
    training ones of the same task (a file: from its last rows), or from ``val_file`` (a
    ``.jsonl``/``.parquet`` file with ``prompt_key`` and ``answer_key``, scored by the training reward),
    passing over every row whose normalised text occurs in training (``controller.data.load_split``).
    ``val_disjoint=false`` takes the rows whatever their text, for a task with too few distinct prompts to
    hold any out (tiny_repeat); the run then counts the held-out prompts it trains on."""

    task: str = setting(
        "chain_sum",
        doc="a registered task (tiny_repeat), a task plug-in module:name, a "
            "reasoning-gym task, or a .jsonl / .parquet file")
    task_kwargs: dict[str, Any] = setting(
        factory=dict,
        doc="options of the task: a reasoning-gym task's (e.g. min_terms), "
            "tiny_repeat's num_symbols")
    size: int = setting(1000, ge=1, doc="examples generated for a procedural task (a file uses all its rows)")
    seed: int = setting(0, doc="seed of a procedural task's examples and of the per-epoch shuffle")
    prompt_key: str = setting("prompt", doc="a data file's column holding the prompt")
    answer_key: str = setting(
        "answer", doc="a data file's column holding the answer (the reward's ground truth)")
    system_prompt: str = setting(
        "", doc="a system turn put before every prompt by the chat template; empty = none")
    train_batch_size: int = setting(4, ge=1, doc="prompts per trainer step (each sampled rollout.n times)")
    max_prompt_length: int = setting(
        256, ge=1, doc="longest prompt in tokens after the chat template; longer ones are an error")
    skip_long_prompts: bool = setting(
        False, doc="skip (and count) prompts over data.max_prompt_length instead of failing")
    epochs: int = setting(
        1, ge=1, doc="passes over the data available to the run (trainer.total_steps must fit in them)")
    drop_last: bool = setting(
        False, doc="drop an epoch's final partial batch instead of training it as a shorter step")
    shuffle: bool = setting(True, doc="reshuffle the prompts each epoch (with data.seed + epoch)")
    val_size: int = setting(
        0, ge=0,
        doc="held-out prompts for validation, drawn after the training rows (or "
            "from data.val_file); 0 = none")
    val_file: str = setting(
        "",
        doc="a .jsonl / .parquet file of validation prompts (its first "
            "data.val_size rows); empty: rows of data.task")
    val_disjoint: bool = setting(
        True,
        doc="held-out prompts never repeat a training prompt's text (rows that do "
            "are passed over); false: any rows")

    def __post_init__(self):
        check_settings(self, "data")
        if self.val_file and not self.val_file.endswith((".jsonl", ".parquet")):
            raise ValueError(f"data.val_file must be a .jsonl or .parquet file, got {self.val_file!r}")
        if self.val_file and not self.val_size:
            raise ValueError(f"data.val_file={self.val_file!r} needs data.val_size >= 1 (rows of it to evaluate)")
        if not self.task:
            raise ValueError("data.task must name a registered task (e.g. 'tiny_repeat'), a task plug-in "
                             "'module:name', a reasoning-gym task, or a .jsonl/.parquet file")
        is_file = self.task.endswith((".jsonl", ".parquet"))
        if not is_file and (self.prompt_key, self.answer_key) != ("prompt", "answer"):
            raise ValueError(f"data.prompt_key / data.answer_key name the columns of a .jsonl/.parquet data.task; "
                             f"data.task={self.task!r} is not a file (got prompt_key={self.prompt_key!r}, "
                             f"answer_key={self.answer_key!r})")
        if is_file and self.task_kwargs:
            raise ValueError(f"data.task_kwargs configure a procedural task; data.task={self.task!r} is a file "
                             f"(got task_kwargs={self.task_kwargs!r})")


@dataclass
class ValConfig:
    """Validation on ``data.val_size`` held-out prompts (``controller.validation``), every
    ``trainer.val_every`` steps, before the first step (``before_train``) and after the last. ``n``:
    samples per prompt at ``rollout.temperature`` (pass@1 and pass@k, Chen et al. 2021); ``greedy``: also
    one greedy response per prompt (temperature 0)."""

    n: int = setting(4, ge=1, doc="validation samples per prompt at rollout.temperature (pass@1, pass@k)")
    greedy: bool = setting(True, doc="also one greedy (temperature 0) validation response per prompt")
    before_train: bool = setting(
        True, doc="validate the initial weights (weight_version 0) before the first step")

    def __post_init__(self):
        check_settings(self, "val")


@dataclass
class MetricsConfig:
    """Prometheus endpoint (``host``:``port``, loopback by default; port 0 = pick a free one), the
    per-step JSONL log in the run directory, and optional trackers: ``tensorboard`` (event files in
    ``RUN_DIR/tensorboard``), ``wandb`` (Weights & Biases, offline into ``RUN_DIR/wandb`` unless
    ``wandb_mode``/the environment says otherwise). ``dump_every``: every N trainer steps, the decoded
    samples of that step (and of validation at that version) go to ``RUN_DIR/generations.jsonl``; 0 = never.
    The job writes its scrape targets as a Prometheus file_sd file, ``RUN_DIR/prometheus_targets.json``;
    ``sd_dir`` (empty = no copy) also puts a copy in that directory, removed when the job ends, for a
    Prometheus watching ``SD_DIR/*.json`` (``controller.prometheus_sd``). ``host`` is any address of the
    controller's machine, ``0.0.0.0`` included (the one socket allowed a wildcard, in a pod: deploy/README.md),
    but not ``node``, which the other ``*.host`` keys take."""

    enabled: bool = setting(True, doc="serve the Prometheus endpoint")
    host: str = setting("127.0.0.1", doc="address of the Prometheus endpoint (loopback by default)")
    port: int = setting(
        0, ge=0, le=65535,
        doc="port of the Prometheus endpoint; 0 = a free one each run (fix it for a scrape target)")
    progress: bool = setting(True, doc="print one progress line per trainer step")
    sd_dir: str = setting(
        "",
        doc="also put the job's Prometheus file_sd targets in this directory; "
            "empty = only in the run dir")
    tensorboard: bool = setting(
        False,
        doc="write the metrics.jsonl scalars as TensorBoard events in "
            "RUN_DIR/tensorboard (pip install tensorboard)")
    wandb: bool = setting(False, doc="log the metrics.jsonl scalars to Weights & Biases (pip install wandb)")
    wandb_project: str = setting("hflow-async", doc="the W&B project of the run")
    wandb_mode: str = setting(
        "offline", choices=WANDB_MODES,
        doc="offline: files in RUN_DIR/wandb (wandb sync uploads them); online")
    dump_every: int = setting(
        0, ge=0,
        doc="every N trainer steps, decoded prompts, responses and rewards to "
            "RUN_DIR/generations.jsonl; 0 = never")

    def __post_init__(self):
        check_settings(self, "metrics")
        if self.host == NODE_HOST:  # the other *.host keys take it; this endpoint is served before Ray starts
            raise ValueError(f"metrics.host={NODE_HOST!r} is not supported: the controller serves the endpoint before it "
                             "joins Ray; give an address of the controller's machine (deploy/README.md, Metrics "
                             "endpoint)")


@dataclass
class RayConfig:
    """``address``: join an existing cluster at ``host:port`` (its GCS, as ``ray start --head`` prints) or
    ``auto`` (the cluster started on this machine); empty = start a local one on loopback. Ray's token
    authentication is always on: a joined cluster's token must be in ``~/.ray/auth_token`` or
    ``RAY_AUTH_TOKEN``. ``connect_timeout_s``: how long joining waits for ``address`` to answer.
    ``num_cpus``: logical CPUs of a local cluster (0 = a safe default for small machines)."""

    address: str = setting(
        "", doc="join a Ray cluster at HOST:PORT or auto; empty = start a local one on loopback")
    connect_timeout_s: float = setting(10.0, gt=0, doc="seconds joining ray.address waits for it to answer")
    num_cpus: int = setting(0, ge=0, doc="logical CPUs of a local cluster; 0 = a default for small machines")
    object_store_bytes: int = setting(1024**3, ge=1, doc="object store size of a local cluster, bytes")

    def __post_init__(self):
        check_settings(self, "ray")
        if self.address and self.address != "auto":
            host, _, port = self.address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"ray.address must be HOST:PORT (e.g. 127.0.0.1:6379), 'auto' or empty, "
                                 f"got {self.address!r}")


@dataclass
class HFlowConfig:
    """The root of the config tree. ``run_dir`` empty means ``runs/<timestamp>``."""

    mode: str = setting(
        "one-step-off", doc="the schedule: sync | one-step-off | fully-async (README, 'Choosing a mode')")
    run_dir: str = setting(
        "", doc="where the run writes its outputs; empty = runs/<timestamp>; must be new or empty")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rollers: RollersConfig = field(default_factory=RollersConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    transferqueue: TransferQueueConfig = field(default_factory=TransferQueueConfig)
    checkpointengine: CheckpointEngineConfig = field(default_factory=CheckpointEngineConfig)
    val: ValConfig = field(default_factory=ValConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self):
        schedule = SCHEDULES.get(self.mode)  # ValueError naming mode and the registered schedules
        if self.trainer.ppo_mini_batch_size > self.data.train_batch_size:
            raise ValueError(
                f"trainer.ppo_mini_batch_size={self.trainer.ppo_mini_batch_size} (prompts) exceeds "
                f"data.train_batch_size={self.data.train_batch_size}"
            )
        if self.trainer.val_every and not self.data.val_size:
            raise ValueError(f"trainer.val_every={self.trainer.val_every} needs held-out prompts: set "
                             "data.val_size >= 1")
        algo = self.algorithm
        algo.bypass_mode = resolve_bypass_mode(schedule.can_be_stale(algo), algo)
        if self.model.compute_dtype == AUTO_DTYPE:  # pinned here, after every merge: the final path and device
            device = None if self.trainer.device == "auto" else self.trainer.device
            self.model.compute_dtype = self.model.resolved_compute_dtype(device)
        if (algo.use_kl_loss or algo.use_kl_in_reward) and not self.trainer.use_reference:
            raise ValueError(
                f"algorithm.use_kl_loss={algo.use_kl_loss} / algorithm.use_kl_in_reward={algo.use_kl_in_reward} "
                "need a reference policy: set trainer.use_reference=true"
            )
        if algo.overlong_buffer_len > self.rollout.max_response_length:
            raise ValueError(
                f"algorithm.overlong_buffer_len={algo.overlong_buffer_len} exceeds "
                f"rollout.max_response_length={self.rollout.max_response_length}: the buffer is the last "
                "tokens before the limit (0 = off)"
            )
        if algo.dynamic_sampling and self.rollout.n < 2:
            raise ValueError(
                f"algorithm.dynamic_sampling=true needs rollout.n >= 2 (a group of one sample never has "
                f"reward variance), got rollout.n={self.rollout.n}"
            )
        # What the job's start-up derives from the settings, checked here so a bad value is a config error
        # (exit 2, before Ray starts) rather than a failure once the pools are starting.
        sample_fields(self)  # ValueError naming algorithm.adv_estimator: a roller extra the rollers cannot put
        self.transferqueue.sized_for(index_samples(self))  # ValueError naming transferqueue.max_samples


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _accepted_keys(node_cls: type, path: list[str]) -> list[str]:
    """Field names accepted at ``path`` (a list of keys) below ``node_cls``."""
    cls = node_cls
    for key in path:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        sub = fields.get(key)
        if sub is None or not dataclasses.is_dataclass(sub.default_factory if sub.default_factory
                                                         is not dataclasses.MISSING else None):
            return []
        cls = sub.default_factory
    return [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []


def _friendly(exc: OmegaConfBaseException, source: str) -> ValueError:
    key = getattr(exc, "full_key", None) or "?"
    if isinstance(exc, ConfigKeyError):
        parent = key.split(".")[:-1]
        accepted = _accepted_keys(HFlowConfig, parent)
        where = ".".join(parent) or "the top level"
        return ValueError(f"unknown config key {key!r} (from {source}); keys accepted in {where}: {accepted}")
    message = (str(getattr(exc, "msg", None) or exc).splitlines() or [type(exc).__name__])[0]
    if isinstance(exc, ValidationError):
        return ValueError(f"bad value for config key {key!r} (from {source}): {message}")
    return ValueError(f"config error at {key!r} (from {source}): {message}")


def check_finite(node: Any, path: str = "") -> None:
    """Raise ValueError naming the first float in the config tree (dataclasses, lists, tuples) that is NaN
    or infinite: no key of this project means anything by a non-finite number."""
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            check_finite(getattr(node, f.name), f"{path}.{f.name}" if path else f.name)
    elif isinstance(node, list | tuple):
        for i, item in enumerate(node):
            check_finite(item, f"{path}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        raise ValueError(f"{path}={node} is not a finite number")


def _kind(value: Any) -> str:
    return "mapping" if isinstance(value, dict) else "list" if isinstance(value, list | tuple) else "single value"


def _shape_conflict(base: dict, other: dict, prefix: str = "") -> tuple[str, str, str] | None:
    """The first key (dotted path) where ``other`` puts a mapping, list or single value in place of another
    of these in ``base`` (plain containers); (key, expected kind, given kind), or None."""
    for key, given in other.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        expected = base.get(key) if isinstance(base, dict) else None
        if expected is None or given is None:  # unknown key, or an optional value: OmegaConf says
            continue
        if _kind(expected) != _kind(given):
            return path, _kind(expected), _kind(given)
        if isinstance(given, dict):
            found = _shape_conflict(expected, given, path)
            if found:
                return found
    return None


def _merge(base, other, source: str):
    try:
        return OmegaConf.merge(base, other)
    except (OmegaConfBaseException, TypeError) as exc:  # TypeError: a list merged into a mapping, or back
        conflict = _shape_conflict(OmegaConf.to_container(base), OmegaConf.to_container(other))
        if conflict:
            key, expected, given = conflict
            raise ValueError(f"bad value for config key {key!r} (from {source}): it takes a {expected}, "
                             f"not a {given}") from None
        if isinstance(exc, TypeError):
            raise ValueError(f"config error (from {source}): {exc}") from None
        raise _friendly(exc, source) from None


def _load_yaml(path: Path):
    """A YAML mapping from ``path``; raises ValueError when the file is missing, not YAML, or not a mapping."""
    import yaml

    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    try:
        loaded = OmegaConf.load(path)
    except (yaml.YAMLError, OmegaConfBaseException) as exc:
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    if not OmegaConf.is_dict(loaded):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of sections (e.g. 'rollout:'), "
                         f"not a {type(loaded).__name__}")
    return loaded


def load_config(
    mode: str | None = None,
    preset: str | None = None,
    config_file: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
) -> HFlowConfig:
    """Resolve the config tree; raises ValueError naming the offending key/value/preset/file.

    ``preset`` and ``config_file`` are exclusive; with neither, the embedded default preset is used. A plug-in
    node (``PLUGIN_NODES``: ``algorithm.policy_loss``) takes the config class of the plug-in its ``name`` (the
    last source that sets it) chooses, with every setting the sources give it (``_plugin_node``).
    """
    if preset and config_file:
        raise ValueError("give either --preset or --config, not both")
    sources = []
    if config_file:
        sources.append((_load_yaml(Path(config_file)), config_file))
    else:
        name = preset or DEFAULT_PRESET
        path = PRESET_DIR / f"{name}.yaml"
        if not path.is_file():
            raise ValueError(f"unknown preset {name!r}; available presets: {available_presets()}")
        sources.append((_load_yaml(path), f"preset {name}"))
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ValueError(f"override {item!r} must look like key.subkey=value")
        sources.append((OmegaConf.from_dotlist([item]), f"override {item!r}"))
    conf = OmegaConf.structured(HFlowConfig)
    plugin_settings: dict[str, dict[str, tuple[Any, str]]] = {path: {} for path, _ in PLUGIN_NODES}
    for node, source in sources:
        tree = OmegaConf.to_container(node, resolve=False)
        _refuse_moved(tree, source)
        for path, _ in PLUGIN_NODES:
            given = _pop(tree, path)
            if given is None:
                continue
            if not isinstance(given, dict):
                raise ValueError(f"{path}={given!r} (from {source}) is now spelled {path}.name={given} (the plug-in's "
                                 f"own settings sit beside its name: {path}.KEY=VALUE)")
            plugin_settings[path].update({key: (value, source) for key, value in given.items()})
        conf = _merge(conf, OmegaConf.create(tree), source)
    for path, registry in PLUGIN_NODES:
        conf = _plugin_node(conf, path, registry, plugin_settings[path])
    if mode is not None:
        conf.mode = mode
    try:
        cfg = OmegaConf.to_object(conf)
    except OmegaConfBaseException as exc:
        raise _friendly(exc, "config") from None
    check_finite(cfg)
    return cfg


def _refuse_moved(tree: dict, source: str, prefix: str = "") -> None:
    """Raise ValueError for the first key of ``tree`` (a source's mapping) that ``MOVED_KEYS`` lists: a flat
    spelling from before, refused with the key that replaced it rather than read."""
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if path in MOVED_KEYS:
            raise ValueError(f"{path} (from {source}) is now spelled {MOVED_KEYS[path]}")
        if isinstance(value, dict):
            _refuse_moved(value, source, f"{path}.")


def _pop(tree: dict, path: str) -> Any:
    """Remove and return the value at dotted ``path`` of the plain mapping ``tree`` (None where absent)."""
    *parents, last = path.split(".")
    node = tree
    for key in parents:
        node = node.get(key) if isinstance(node, dict) else None
    return node.pop(last, None) if isinstance(node, dict) else None


def _plugin_node(conf, path: str, registry: Registry, given: dict[str, tuple[Any, str]]):
    """``conf`` with the node at ``path`` replaced by the config class of the plug-in ``name`` chooses
    (``given['name']``, else the tree's default), merged with the settings ``given`` (key -> (value, source)).
    Raises ValueError naming the source for an unknown plug-in or a key its config class does not declare."""
    name, source = given.get("name", (OmegaConf.select(conf, f"{path}.name"), "the default"))
    try:
        cls = registry.config(name)
    except ValueError as exc:
        raise ValueError(f"{exc} (from {source})") from None
    keys = [f.name for f in dataclasses.fields(cls)]
    for key, (_, where) in given.items():
        if key not in keys:
            raise ValueError(f"unknown config key '{path}.{key}' (from {where}): {registry.kind} {name!r} takes "
                             f"{keys} ({cls.__name__})")
    OmegaConf.update(conf, path, OmegaConf.structured(cls(name=name)), merge=False)
    for key, (value, where) in given.items():
        conf = _merge(conf, OmegaConf.create(_nest(f"{path}.{key}", value)), where)
    return conf


def _nest(path: str, value: Any) -> dict:
    """``{'a': {'b': value}}`` for ``path`` ``a.b``."""
    for key in reversed(path.split(".")):
        value = {key: value}
    return value


def to_yaml(cfg: HFlowConfig) -> str:
    """The resolved tree as YAML (what ``hflow-async show-config`` prints)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: HFlowConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def with_defaults(tree: dict[str, Any], cls: type = HFlowConfig, prefix: str = "") -> dict[str, Any]:
    """``tree`` (a ``to_dict`` tree of ``cls``, e.g. the config a job checkpoint saved) with every key it lacks
    added with its default: a tree written before that key existed. Sections are filled key by key (a plug-in
    node by the config class of the plug-in it names, when that is registered); a free mapping
    (``data.task_kwargs``) is kept as it is, and so is a key ``cls`` no longer has."""
    defaults = OmegaConf.to_container(OmegaConf.structured(cls), resolve=True)
    out = dict(tree)
    registries = dict(PLUGIN_NODES)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        if f.name not in out:
            out[f.name] = defaults[f.name]
        elif path in registries and isinstance(out[f.name], dict):
            try:
                sub = registries[path].config(out[f.name].get("name"))
            except ValueError:  # not registered here: kept as saved
                continue
            out[f.name] = with_defaults(out[f.name], sub, f"{path}.")
        elif dataclasses.is_dataclass(f.default_factory) and isinstance(out[f.name], dict):
            out[f.name] = with_defaults(out[f.name], f.default_factory, f"{path}.")
    return out
