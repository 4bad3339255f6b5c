"""One registry per extension point: the single source of truth for its names.

Each registry is owned by the package that implements its plug-ins: the trainers' (below), weight-sync
backends (``checkpointengine.backend``), samplers (``transferqueue.samplers``), rewards
(``rollers.rewards``), environments (``rollers.environments``) and tasks (``controller.tasks``).
Each extension point of the trainers (advantage estimators, policy losses, KL estimators, loss
aggregation modes) is a typed plug-in object — a small frozen dataclass carrying its function *and* its
wiring (e.g. an estimator's ``needs_critic``) — registered under a name in one :class:`Registry`. Config
validates names against the registry (``AlgorithmConfig.__post_init__``), call sites ask the plug-in
(``estimator.needs_critic``), never compare its name as a string. A plug-in with settings of its own
registers their dataclass with it (``Registry.register(name, plugin, config=...)``; the policy losses' do),
and the config tree nests them under the plug-in's node: ``algorithm.policy_loss: {name: sapo, tau_pos: 1.0}``.

Plug-ins from outside the package: a config value ``module:name`` (e.g.
``algorithm.adv_estimator=my_pkg.algos:my_estimator``) imports ``module`` — whose import registers its
plug-ins with the usual decorator (``@register_adv_estimator("my_estimator")``) — and then looks ``name``
up in the registry. Every process that resolves the spec imports the module itself (the controller when
it validates the config, each trainer rank when it builds its worker), so the module must be importable
there: on ``PYTHONPATH``, installed, or in the directory the ``hflow-async`` command runs from (the CLI puts
it on ``sys.path`` before it reads the config, and the job hands it to its Ray workers).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Names → plug-ins of one kind. ``key`` is the config key that selects one (for error messages)."""

    def __init__(self, kind: str, key: str):
        self.kind, self.key = kind, key
        self._items: dict[str, T] = {}
        self._configs: dict[str, type] = {}

    def register(self, name: str, plugin: T, config: type | None = None) -> T:
        """Add ``plugin`` under ``name``, with ``config``: the dataclass of its own settings, if its kind has
        them (nested under the plug-in's name in the config tree). Raises ValueError on an empty name, a ``:``
        in it (reserved for ``module:name`` specs) or a name already taken."""
        if not name or ":" in name:
            raise ValueError(f"{self.kind} name {name!r} must be non-empty and contain no ':'")
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = plugin
        if config is not None:
            self._configs[name] = config
        return plugin

    def config(self, spec: str, key: str | None = None) -> type | None:
        """The settings dataclass the plug-in ``spec`` (a name or ``module:name``, as :meth:`get`) registered
        with, or None; raises ValueError as :meth:`get` when there is no such plug-in."""
        self.get(spec, key)
        return self._configs.get(spec.rpartition(":")[2])

    def get(self, spec: str, key: str | None = None) -> T:
        """The plug-in for ``spec``: a registered name, or ``module:name`` (imports ``module``, which
        registers its plug-ins, then looks ``name`` up). Raises ValueError naming the config key (``key``,
        default the registry's), the value and the registered names when there is no such plug-in or the
        module cannot be imported."""
        key = key or self.key
        if not isinstance(spec, str):
            raise ValueError(f"{key} must be a string, got {spec!r}")
        name = spec
        if ":" in spec:
            module_name, _, name = spec.partition(":")
            if not module_name or not name:
                raise ValueError(f"{key}={spec!r}: a plug-in from outside must look like 'module:name'")
            try:
                importlib.import_module(module_name)
            except Exception as exc:  # a user's module may fail to import in any way: a config error either way
                raise ValueError(f"{key}={spec!r}: cannot import {module_name!r}: "
                                 f"{type(exc).__name__}: {exc}") from exc
            if name not in self._items:
                raise ValueError(f"{key}={spec!r}: importing {module_name!r} registered no {self.kind} "
                                 f"named {name!r}; registered: {self.names()}")
        if name not in self._items:
            raise ValueError(f"{key}={spec!r} is not one of {self.names()} (or 'module:name' of a plug-in "
                             "module that registers it)")
        return self._items[name]

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)
