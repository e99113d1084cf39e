"""The reduced draft vocabulary: which ids are chosen, the id map, its file and fingerprint, the token counts."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from longspec.data import Manifest, ShardWriter
from longspec.data.token_counts import token_counts
from longspec.drafter.vocab import DRAFT_VOCAB_NAME, DraftVocab, special_token_ids


def test_from_counts_keeps_specials_then_the_most_frequent():
    counts = np.array([5, 0, 9, 9, 1, 7, 0, 3])
    vocab = DraftVocab.from_counts(counts, 4, keep=[6])
    # 6 is kept whatever its count; then 2 and 3 (9 each, the lower id first) and 5 (7).
    assert vocab.ids.tolist() == [2, 3, 5, 6]
    assert vocab.size == 4 and vocab.vocab_size == 8


def test_ties_go_to_the_lower_id():
    vocab = DraftVocab.from_counts(np.ones(10, dtype=np.int64), 3)
    assert vocab.ids.tolist() == [0, 1, 2]


def test_full_size_is_every_id():
    vocab = DraftVocab.from_counts(np.arange(6), 6, keep=[0])
    assert vocab.ids.tolist() == list(range(6))


@pytest.mark.parametrize(
    ("size", "keep", "message"),
    [
        (0, [], r"draft_vocab_size must be in \[1, 8\]"),
        (9, [], r"draft_vocab_size must be in \[1, 8\]"),
        (1, [0, 1], "smaller than the 2 special"),
        (3, [8], "outside the vocabulary"),
    ],
)
def test_bad_sizes_and_specials_are_one_error(size, keep, message):
    with pytest.raises(ValueError, match=message):
        DraftVocab.from_counts(np.ones(8), size, keep=keep)


@pytest.mark.parametrize(
    "ids",
    [
        torch.tensor([3, 1]),
        torch.tensor([1, 1]),
        torch.tensor([0, 8]),
        torch.tensor([-1, 2]),
        torch.tensor([], dtype=torch.long),
        torch.tensor([1.0, 2.0]),
    ],
)
def test_invalid_ids_are_refused(ids):
    with pytest.raises(ValueError, match="draft vocabulary ids"):
        DraftVocab(ids, 8)


def test_target_to_draft_inverts_ids():
    vocab = DraftVocab(torch.tensor([1, 4, 6]), 8)
    table = vocab.target_to_draft()
    assert table.tolist() == [-1, 0, -1, -1, 1, -1, 2, -1]
    assert torch.equal(vocab.ids[table[vocab.ids]], vocab.ids)


def test_coverage_counts_the_tokens_inside():
    vocab = DraftVocab(torch.tensor([0, 2]), 4)
    assert vocab.coverage(np.array([3, 1, 5, 1])) == pytest.approx(0.8)


def test_save_load_round_trip_and_fingerprint(tmp_path):
    vocab = DraftVocab(torch.tensor([0, 5, 7, 100]), 128)
    path = vocab.save(tmp_path)
    assert os.path.basename(path) == DRAFT_VOCAB_NAME and os.listdir(tmp_path) == [DRAFT_VOCAB_NAME]
    loaded = DraftVocab.load(tmp_path)
    assert torch.equal(loaded.ids, vocab.ids) and loaded.vocab_size == 128
    assert loaded.fingerprint() == vocab.fingerprint()
    assert DraftVocab(torch.tensor([0, 5, 7, 101]), 128).fingerprint() != vocab.fingerprint()
    assert DraftVocab(torch.tensor([0, 5, 7, 100]), 129).fingerprint() != vocab.fingerprint()


def test_load_without_a_map_is_the_full_vocabulary(tmp_path):
    assert DraftVocab.load(tmp_path) is None


def test_a_damaged_or_altered_map_is_one_error(tmp_path):
    from safetensors.torch import save_file

    path = DraftVocab(torch.tensor([0, 5, 7]), 16).save(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(20)
    with pytest.raises(ValueError, match=f"{DRAFT_VOCAB_NAME} is not a readable draft vocabulary"):
        DraftVocab.load(tmp_path)
    # ids rewritten without their fingerprint
    save_file({"ids": torch.tensor([0, 5, 8])}, path, metadata={"vocab_size": "16", "sha256": "0" * 64})
    with pytest.raises(ValueError, match="do not match the fingerprint"):
        DraftVocab.load(tmp_path)


def test_special_token_ids_include_added_tokens():
    from transformers import AutoTokenizer

    root = os.path.join(os.path.dirname(__file__), "..", "longspec", "assets", "code_target")
    tokenizer = AutoTokenizer.from_pretrained(root)
    ids = special_token_ids(tokenizer)
    assert set(tokenizer.all_special_ids) <= set(ids)
    assert set(int(i) for i in tokenizer.added_tokens_decoder) <= set(ids)
    assert ids == sorted(set(ids))


def _dataset(directory, rows, masks=None):
    directory.mkdir()
    writer = ShardWriter(directory, token_dtype="uint16", has_loss_mask=masks is not None, shard_tokens=4)
    for i, row in enumerate(rows):
        writer.add(np.asarray(row), None if masks is None else np.asarray(masks[i]))
    writer.finish(
        Manifest(
            stage="t",
            source="s",
            seq_len=8,
            packed=False,
            has_loss_mask=masks is not None,
            token_dtype="uint16",
            tokenizer={"vocab_size": 10},
        )  # fmt: skip
    )
    return directory


def test_token_counts_count_trained_tokens_over_datasets(tmp_path):
    plain = _dataset(tmp_path / "a", [[1, 2, 2], [3, 3, 3, 9]])
    masked = _dataset(tmp_path / "b", [[4, 5, 6], [7, 7]], masks=[[0, 1, 1], [1, 0]])
    counts = token_counts([plain, masked], 10)
    assert counts.tolist() == [0, 1, 2, 3, 0, 1, 1, 1, 0, 1]


def test_token_counts_refuse_ids_beyond_the_vocabulary(tmp_path):
    data = _dataset(tmp_path / "a", [[1, 12]])
    with pytest.raises(ValueError, match="token id 12, outside the target's vocabulary of 10"):
        token_counts([data], 10)


def test_head_rows_come_from_a_whole_head_of_the_same_vocabulary():
    vocab = DraftVocab(torch.tensor([1, 3]), 5)
    lm_head = torch.nn.Linear(4, 5, bias=False)
    head = vocab.head(lm_head)
    assert torch.equal(head.weight, lm_head.weight[[1, 3]]) and not head.weight.requires_grad
    with pytest.raises(ValueError, match=r"maps into a vocabulary of 5 ids, but the LM head has 6 rows"):
        vocab.head(torch.nn.Linear(4, 6, bias=False))
    lm_head.weight.ds_id = 0  # how DeepSpeed marks a ZeRO-3 parameter (its tensor then holds no rows)
    with pytest.raises(ValueError, match="the LM head is a ZeRO-3 shard"):
        vocab.head(lm_head)
