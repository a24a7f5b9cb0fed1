"""``collate``'s checks of what it is given."""

from __future__ import annotations

import dataclasses

import pytest

from clew.train.model_batch import Sample, collate


def test_collate_names_a_sequence_whose_placeholders_do_not_match_its_images(chat, seqs):
    with_images = next(s for s in seqs if len(s.images) >= 2)
    assert collate([with_images], chat).num_target_tokens > 0
    short = dataclasses.replace(with_images, images=with_images.images[:-1])
    text = Sample([1, 2, 3], [0, 1, 1])
    with pytest.raises(ValueError, match=r"sequence 1 holds \d+ image placeholder tokens but its"):
        collate([text, short], chat)


def test_collate_refuses_a_loss_mask_of_another_length(chat):
    with pytest.raises(ValueError, match="3 tokens but a loss mask of 2 entries"):
        collate([Sample([1, 2, 3], [0, 1])], chat)
