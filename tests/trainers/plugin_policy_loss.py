"""A policy loss from outside the package, with a setting of its own — the whole of what adding one takes.

Selected with ``algorithm.policy_loss.name=tests.trainers.plugin_policy_loss:unclipped`` (and, say,
``algorithm.policy_loss.scale=2``): importing this module registers the plug-in and its config class
(``common/registry.py``), in the controller and in each trainer rank; the config tree then nests
:class:`UnclippedConfig` under ``algorithm.policy_loss``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.settings import setting
from trainers.policy_losses import (
    PolicyLossConfig,
    PolicyLossInputs,
    PolicyLossParams,
    PolicyLossTerms,
    register_policy_loss,
)


@dataclass
class UnclippedConfig(PolicyLossConfig):
    """``unclipped``'s own setting."""

    scale: float = setting(1.0, gt=0, doc="unclipped: weight of the surrogate")


@register_policy_loss("unclipped", config=UnclippedConfig)
def unclipped(x: PolicyLossInputs, p: PolicyLossParams, c: UnclippedConfig) -> PolicyLossTerms:
    """The unclipped surrogate ``l = -scale * A r`` (Schulman et al. 2017, "Proximal Policy Optimization
    Algorithms", eq. 6: conservative policy iteration's objective), aggregated by ``algorithm.loss_agg_mode``."""
    return PolicyLossTerms(-c.scale * x.advantages * torch.exp(x.log_ratio))
