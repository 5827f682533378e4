"""``sparse_k.selection.beam_rows``: a module-held memo of each row's block-first query follows a beam reorder of the
cache's rows, found from the keys alone (the end-to-end check is tests/integration/test_transformers_generate.py's
beam search with Transformers' caches)."""

import pytest
import torch
from sparse_k.layouts.token_layout import TokenLayout
from sparse_k.selection.beam_rows import FINGERPRINT, realign, remember

QB = 4


def _memo_after_call(key, blocks, k_start):
    """A memo as ``page_selection.block_queries`` leaves it (block ids, first queries), fingerprinted by ``remember``."""
    B = key.shape[0]
    memo = {"block": torch.tensor(blocks, dtype=torch.int64), "q": torch.randn(B, 4, 8), "block_host": list(blocks)}
    remember(memo, key, k_start, QB)
    return memo


def test_a_beam_reorder_is_followed_and_an_unmoved_memo_stays():
    B, S = 4, 14
    key = torch.randn(B, 2, S, 8)
    k_start = torch.tensor([0, 0, 1, 1])  # rows 2 and 3 padded by one key on the left
    memo = _memo_after_call(key, [3, 3, 3, 2], k_start)
    q_before, row_key = memo["q"].clone(), memo[FINGERPRINT].clone()
    assert torch.equal(row_key[0], key[0, :, 12]) and torch.equal(row_key[2], key[2, :, 13])
    assert torch.equal(row_key[3], key[3, :, 9])

    realign(memo, key, k_start, QB)  # nothing moved
    assert torch.equal(memo["q"], q_before) and memo["block"].tolist() == [3, 3, 3, 2]

    beam_idx = torch.tensor([1, 1, 3, 2])  # what cache.reorder_cache(beam_idx) does to the keys
    realign(memo, key.index_select(0, beam_idx), k_start, QB)
    assert torch.equal(memo["q"], q_before.index_select(0, beam_idx))
    assert memo["block"].tolist() == [3, 3, 2, 3]
    assert torch.equal(memo[FINGERPRINT], row_key)  # realign reads the fingerprint, remember rewrites it


def test_equal_prefixes_keep_their_own_rows_and_the_reused_layout_follows():
    B, S = 3, 10
    key = torch.randn(B, 2, S, 8)
    key[1] = key[0]  # rows 0 and 1 share their prefix: either memo is right, the row keeps its own
    k_start = torch.zeros(B, dtype=torch.int64)
    memo = _memo_after_call(key, [2, 2, 2], k_start)
    memo["q"][1] = memo["q"][0]  # equal prefixes up to the block start: equal first queries
    idx = torch.arange(B * 2 * 1 * 3, dtype=torch.int32).view(B, 2, 1, 3)
    memo["layout"] = TokenLayout(indices=idx, counts=torch.full((B, 2, 1), 3, dtype=torch.int32), query_block=QB,
                                 first_block=torch.full((B,), 2, dtype=torch.int64))
    q_before = memo["q"].clone()
    realign(memo, key, k_start, QB)
    assert torch.equal(memo["q"], q_before)

    beam_idx = torch.tensor([2, 0, 0])
    realign(memo, key.index_select(0, beam_idx), k_start, QB)
    assert torch.equal(memo["q"], q_before[[2, 0, 0]])  # rows 1, 2 continue row 0 (or row 1: the same memo)
    assert torch.equal(memo["layout"].indices, idx[[2, 1, 0]])  # a tie goes to the row itself, else to the first row


def test_unset_blocks_slots_past_the_keys_and_one_row_batches_are_left_alone():
    key = torch.randn(2, 2, 8, 8)
    memo = _memo_after_call(key, [-1, 5], torch.zeros(2, dtype=torch.int64))  # block 5 starts at key 20 > 8 keys
    assert memo[FINGERPRINT].abs().sum() == 0
    q_before = memo["q"].clone()
    realign(memo, key.flip(0), torch.zeros(2, dtype=torch.int64), QB)
    assert torch.equal(memo["q"], q_before)

    one = {"block": torch.tensor([1]), "q": torch.randn(1, 4, 8)}
    remember(one, torch.randn(1, 2, 8, 8), torch.zeros(1, dtype=torch.int64), QB)
    assert FINGERPRINT not in one
    realign(None, key, torch.zeros(2, dtype=torch.int64), QB)  # no memo: nothing to do


@pytest.mark.parametrize("batch", [3, 2])
def test_a_memo_of_another_batch_size_is_not_touched(batch):
    key = torch.randn(3, 2, 8, 8)
    memo = _memo_after_call(key, [1, 1, 1], torch.zeros(3, dtype=torch.int64))
    q_before = memo["q"].clone()
    other = torch.randn(batch, 2, 8, 8) if batch != 3 else torch.randn(3, 1, 8, 8)  # other rows / other KV heads
    realign(memo, other, torch.zeros(batch, dtype=torch.int64), QB)
    assert torch.equal(memo["q"], q_before)
