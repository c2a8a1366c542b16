"""Shared-prompt forward rows (`streamrl.learner.packing`) on a hand-made batch: the row's
tokens, the positions each response would have alone, who attends to whom, and which hidden
state scores each response token."""

from __future__ import annotations

import torch

from streamrl.learner.packing import forward_rows, shared_prompt_mask

# Two prompts: [10, 11, 12] with responses [20, 21] and [30]; [40, 41] with response [50, 51, 52].
PROMPT = torch.tensor([3, 3, 2])
RESPONSE = torch.tensor([2, 1, 3])
SEQUENCES = [[10, 11, 12, 20, 21], [10, 11, 12, 30], [40, 41, 50, 51, 52]]
TOKENS = torch.tensor([t for seq in SEQUENCES for t in seq])
SEQ_START = torch.tensor([0, 5, 9])
VIEW = 4  # T − 1 of the per-response view: the longest sequence has 5 tokens


def rows(units):
    return forward_rows(PROMPT, RESPONSE, TOKENS, SEQ_START, units, view_length=VIEW)


def test_a_group_is_its_prompt_once_then_each_response_at_its_own_positions():
    packed = rows([torch.tensor([0, 1]), torch.tensor([2])])
    assert packed.input_ids.tolist() == [[10, 11, 12, 20, 21, 30], [40, 41, 50, 51, 52, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 2, 3, 4, 0]]
    assert packed.attention_mask.tolist() == [[1] * 6, [1] * 5 + [0]]
    assert packed.segments.tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 1, 1, 1, -1]]
    dense = shared_prompt_mask(packed.segments, "sdpa")
    assert dense.shape == (2, 1, 6, 6)
    assert dense.dtype == torch.bool
    mask = dense[0, 0].int().tolist()
    assert mask[2] == [1, 1, 1, 0, 0, 0]  # the prompt sees the prompt
    assert mask[4] == [1, 1, 1, 1, 1, 0]  # response 0 sees the prompt and itself
    assert mask[5] == [1, 1, 1, 0, 0, 1]  # response 1 sees the prompt and itself, not response 0
    pad = dense[1, 0, 5].int().tolist()
    assert pad == [0, 0, 0, 0, 0, 1]  # padding sees only itself (no all-masked row: no NaN)


def test_each_response_token_is_scored_by_the_hidden_state_before_it():
    packed = rows([torch.tensor([0, 1]), torch.tensor([2])])
    width = packed.input_ids.shape[1]
    # response 0 ([20, 21] after a 3-token prompt): targets j = 2, 3 scored at row 0, 2 and 3
    assert packed.gather[0, 2:].tolist() == [2, 3]
    # response 1 ([30]): its one token is scored by the prompt's last position, shared
    assert packed.gather[1, 2] == 2
    # response 2 ([50, 51, 52] after a 2-token prompt): j = 1, 2, 3 at row 1, 1..3
    assert packed.gather[2, 1:].tolist() == [width + 1, width + 2, width + 3]


def test_rows_of_one_response_each_are_todays_rows_with_a_padding_mask():
    packed = rows([torch.tensor([0]), torch.tensor([1]), torch.tensor([2])])
    assert packed.segments is None
    assert packed.input_ids.tolist() == [s + [0] * (5 - len(s)) for s in SEQUENCES]
    width = 5
    for i in range(3):  # target j of response i is scored at position j of its row
        j = torch.arange(VIEW)
        valid = (j >= PROMPT[i] - 1) & (j < PROMPT[i] + RESPONSE[i] - 1)
        assert packed.gather[i][valid].tolist() == (i * width + j[valid]).tolist()
