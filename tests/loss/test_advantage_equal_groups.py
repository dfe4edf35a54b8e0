"""centre_equal_groups=false: a group of equal rewards uses the objective's baseline instead of its own mean."""

import pytest
import torch

from offline_rec.loss.advantages import group_advantages
from offline_rec.loss.objective import Objective

REWARDS = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
GROUPS = [0, 0, 0, 1, 1, 1, 2, 2, 3]
"""An all-wrong group (0), a mixed one (1: p = 2/3), an all-right one (2) and a singleton (3)."""


def test_equal_groups_use_the_constant_baseline_by_hand():
    # kappa 0: the mixed group's rows keep A = r (1, 0, 1); all-wrong -> 0 - 0.1, all-right -> 1 - 0.1; the
    # singleton uses the baseline as before
    objective = Objective(group_mean_scale=0.0, centre_equal_groups=False, baseline="constant", baseline_value=0.1)
    advantages, keep = group_advantages(objective, REWARDS, GROUPS)
    assert advantages.tolist() == pytest.approx([-0.1, -0.1, -0.1, 1.0, 0.0, 1.0, 0.9, 0.9, 0.9])
    assert keep.all()
    # kappa 1: the mixed group is centred (1 - 2/3, -2/3, 1 - 2/3); the equal groups as above
    objective = Objective(centre_equal_groups=False, baseline="constant", baseline_value=0.25)
    advantages, _ = group_advantages(objective, REWARDS, GROUPS)
    assert advantages.tolist() == pytest.approx([-0.25] * 3 + [1 / 3, -2 / 3, 1 / 3] + [0.75] * 3)


def test_centring_equal_groups_is_the_default_and_changes_nothing_else():
    centred = Objective(baseline="constant", baseline_value=0.1)
    advantages, _ = group_advantages(centred, REWARDS, GROUPS)
    assert advantages.tolist() == pytest.approx([0.0] * 3 + [1 / 3, -2 / 3, 1 / 3] + [0.0, 0.0, 0.9])
    # the dataset baseline reaches the equal groups too: A = r - mu_D
    from offline_rec.loss.advantages import RewardMoments

    moments = RewardMoments.of([0.0, 1.0, 1.0, 0.0])  # mu_D = 0.5
    objective = Objective(centre_equal_groups=False, baseline="dataset")
    advantages, _ = group_advantages(objective, REWARDS, GROUPS, dataset_moments=moments)
    assert advantages.tolist() == pytest.approx([-0.5] * 3 + [1 / 3, -2 / 3, 1 / 3] + [0.5] * 3)


def test_a_group_equal_once_red_drop_removed_its_negatives_is_judged_on_its_kept_rows():
    # RED-Drop keeps as many negatives as positives: [1, 0, 0, 0] keeps 1 and one 0: not equal, centred
    objective = Objective(centre_equal_groups=False, baseline="constant", baseline_value=0.1, drop="balance")
    advantages, keep = group_advantages(objective, torch.tensor([1.0, 0.0, 0.0, 0.0]), [0, 0, 0, 0],
                                        torch.Generator().manual_seed(0))
    assert int(keep.sum()) == 2 and advantages[keep].tolist() == pytest.approx([0.5, -0.5])


def test_centre_equal_groups_false_needs_a_baseline():
    with pytest.raises(ValueError, match="centre_equal_groups=false needs a baseline other than group"):
        Objective(centre_equal_groups=False)
    with pytest.raises(ValueError, match="must be a bool"):
        Objective(centre_equal_groups="no", baseline="constant")
