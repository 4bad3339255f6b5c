"""A policy loss from outside the package — the whole of what adding one takes.

Selected with ``algorithm.policy_loss=tests.trainers.plugin_policy_loss:unclipped``: importing this module
registers the plug-in (``common/registry.py``), in the controller and in each trainer rank.
"""

from __future__ import annotations

import torch

from trainers.policy_losses import PolicyLossInputs, PolicyLossParams, PolicyLossTerms, register_policy_loss


@register_policy_loss("unclipped")
def unclipped(x: PolicyLossInputs, p: PolicyLossParams) -> PolicyLossTerms:
    """The unclipped surrogate ``l = -A r`` (Schulman et al. 2017, "Proximal Policy Optimization
    Algorithms", eq. 6: conservative policy iteration's objective), aggregated by ``algorithm.loss_agg_mode``."""
    return PolicyLossTerms(-x.advantages * torch.exp(x.log_ratio))
