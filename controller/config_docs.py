"""One line per config key: what ``hflow-async show-config --describe`` prints beside each key.

Each key declares its one-line description, bounds and choices once, in its field's metadata
(``common.settings.setting``); :func:`key_docs` reads them from the config tree
(``controller.config.HFlowConfig``, with the config class of each chosen plug-in). The dataclass docstrings
of each section (``rollers/config.py``, ``trainers/config.py``, ...) hold the longer story. A test checks that
every field of every section and plug-in config has a description, so a new key without one fails the
suite. Units are in the key name or the line: lengths in tokens, times in seconds, sizes in bytes.

Two settings need more than a line:

* ``old_log_probs`` (``algorithm.bypass_mode``, ``trainers/rollout_corr.py``). ``null`` (the default):
  ``true`` where trained samples can come from older weights (``one-step-off``; ``fully-async`` with
  ``max_staleness >= 1``) and ``stale_correction`` is ``none``, else ``false``; ``show-config`` prints the
  choice. ``false``: the trainer's own log-probs before the update, recomputed with one extra forward, except when that
  forward provably gives the first training forward's numbers: every sample's ``min_weight_version`` and
  ``max_weight_version`` equal the trainer's ``weight_version`` (``sync``; ``fully-async`` at staleness 0;
  the first step of ``one-step-off``), ``trainer.ppo_epochs`` is 1 with one mini-batch
  (``trainer.ppo_mini_batch_size`` = the step's prompts), and no ``algorithm.use_kl_in_reward``. Then the
  loss takes the training forward's log-probs, detached, and the step reports
  ``actor/old_log_prob_recomputed`` 0. ``true`` (verl's bypass mode): the rollers' ``rollout_log_probs``
  are ``old_log_probs`` in every mode, no extra forward; refused with a ``stale_correction``. Each step
  reports ``rollout_corr/kl``, ``rollout_corr/k3_kl`` and ``rollout_corr/max_abs_diff`` (rollout vs
  trainer log-probs on response tokens) whenever both exist.
* ``rollers.num_threads`` / ``trainer.num_threads`` (``controller/resources.py``): ``auto`` (the
  default) or an integer; see ``plan_threads``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any

from common.settings import accepted, doc_of
from controller.config import HFlowConfig, to_yaml


def _sections(node: Any) -> Iterator[tuple[dataclasses.Field, Any]]:
    """The fields of ``node`` (a config dataclass or an instance of one), each with its nested section (a
    class or an instance: a plug-in's config is the class the instance holds) or None for a leaf."""
    for f in dataclasses.fields(node):
        if not isinstance(node, type):
            value = getattr(node, f.name)
            yield f, value if dataclasses.is_dataclass(value) else None
        elif f.default_factory is not dataclasses.MISSING:
            sub = f.default_factory if isinstance(f.default_factory, type) else f.default_factory()
            yield f, sub if dataclasses.is_dataclass(sub) else None
        else:
            yield f, None


def config_fields(node: Any = HFlowConfig, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every leaf key of the config tree ``node`` (the class: its defaults; an instance: with the plug-in
    configs it chose) in declaration order, dotted (``algorithm.max_staleness``), with its field; a
    dict-valued key (``data.task_kwargs``) is a leaf."""
    out = {}
    for f, sub in _sections(node):
        if sub is not None:
            out.update(config_fields(sub, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = f
    return out


def config_keys(node: Any = HFlowConfig) -> list[str]:
    """The dotted leaf keys of :func:`config_fields`."""
    return list(config_fields(node))


def key_doc(f: dataclasses.Field) -> str:
    """The line ``show-config --describe`` prints for a key: its doc (``common.settings.setting``) and, when
    the field declares bounds or choices, what it accepts."""
    what = accepted(f)
    return f"{doc_of(f)} [{what}]" if what else doc_of(f)


def key_docs(node: Any = HFlowConfig) -> dict[str, str]:
    """Dotted key -> :func:`key_doc` line, for every leaf key of ``node``."""
    return {key: key_doc(f) for key, f in config_fields(node).items()}


_KEY_LINE = re.compile(r"^(?P<indent> *)(?P<quote>'?)(?P<key>\w+)(?P=quote):(?P<rest>.*)$")


def to_described_yaml(cfg: HFlowConfig) -> str:
    """``to_yaml(cfg)`` with each key's :func:`key_doc` line as a YAML comment after it (still valid YAML:
    the output can be saved and passed back with ``--config``)."""
    docs, out, path = key_docs(cfg), [], []
    for line in to_yaml(cfg).splitlines():
        m = _KEY_LINE.match(line)
        if m is None:  # a list item or a line inside a dict value
            out.append(line)
            continue
        depth = len(m["indent"]) // 2
        path = path[:depth] + [m["key"]]
        doc = docs.get(".".join(path))
        out.append(f"{line}  # {doc}" if doc else line)
    return "\n".join(out) + "\n"
