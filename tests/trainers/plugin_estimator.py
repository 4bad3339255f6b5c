"""An advantage estimator from outside the package — the whole of what adding one takes.

Selected with ``algorithm.adv_estimator=tests.trainers.plugin_estimator:group_max_baseline``: importing
this module registers the plug-in (``common/registry.py``), in the controller and in each trainer rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from common import schema
from trainers.advantages import group_index, register_adv_estimator


@register_adv_estimator("group_max_baseline", input_fields=(schema.UID,), group_local=True)
def group_max_baseline(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uid: Sequence[Any] | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``A_i = s_i - max(s_group)`` on every valid token (an example, not a published estimator): the best
    sample of a group gets 0, the others a negative advantage. Shapes ``(batch, response_len)``."""
    scores = (token_level_rewards * response_mask).sum(dim=-1)
    index, num_groups = group_index(uid, scores.shape[0])
    best = torch.full((num_groups,), -torch.inf, dtype=scores.dtype).scatter_reduce(0, index, scores, "amax")
    advantages = (scores - best[index]).unsqueeze(-1) * response_mask
    return advantages, advantages.clone()
