"""models.padding.right_padded: the next-token layout, checked by hand."""

import numpy as np

from offline_rec.models.padding import right_padded


def test_rows_by_hand():
    # row 0: prompt [5, 6], completion [7, 8, 9] with loss_mask [1, 0, 1]; row 1: empty prompt, completion [3, 4]
    ids, attention, scored, placed = right_padded(
        [[5, 6], []], [[7, 8, 9], [3, 4]], pad_id=0, loss_masks=[np.array([1, 0, 1], np.int8), None],
        values=[np.array([-0.1, -0.2, -0.3], np.float32), np.array([-1.0, -2.0], np.float32)])
    assert ids.tolist() == [[5, 6, 7, 8, 9], [3, 4, 0, 0, 0]]
    assert attention.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # position t predicts token t+1: row 0's completion is scored at 1, 2, 3 (token 8 masked out);
    # row 1's first token has no context, its second is scored at 0
    assert scored.tolist() == [[False, True, False, True], [True, False, False, False]]
    assert placed.tolist() == [[0.0, np.float32(-0.1), np.float32(-0.2), np.float32(-0.3)], [-2.0, 0.0, 0.0, 0.0]]


def test_without_masks_or_values_every_completion_token_is_scored():
    ids, _, scored, placed = right_padded([[1]], [[2, 3]], pad_id=9)
    assert ids.tolist() == [[1, 2, 3]] and scored.tolist() == [[True, True]] and placed is None


def test_a_lone_token_keeps_one_column():
    _, _, scored, placed = right_padded([[1]], [[]], pad_id=0, values=[np.zeros(0, np.float32)])
    assert scored.shape == (1, 1) and not scored.any() and placed.tolist() == [[0.0]]
