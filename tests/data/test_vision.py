"""Images in prompts without an engine: reading them, 01's expansion of their placeholders, 02's requests.

vLLM's processor (what says how many tokens an image becomes) is replaced by a fixed count here; the
tiny Kimi pipeline test runs the real one, in 01 and in 02's engine.
"""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from eagle3_pipeline.data.conversations import InvalidConversation
from eagle3_pipeline.data.samples import _expand_images
from eagle3_pipeline.data.vision import Vision, read_image, request

PAD = 9  # the placeholder token id of these tests


class FixedVision(Vision):
    """Every image becomes `per_image` placeholder tokens, taken as Kimi's vision_chunk items."""

    def __init__(self, per_image: int):
        self.token_id, self.modality, self.per_image = PAD, "vision_chunk", per_image

    def tokens(self, image: bytes) -> int:
        return self.per_image


def png(colour: tuple[int, int, int]) -> bytes:
    encoded = io.BytesIO()
    Image.new("RGB", (28, 28), colour).save(encoded, format="PNG")
    return encoded.getvalue()


def test_images_are_read_from_paths_and_data_urls_and_unreadable_ones_skipped(tmp_path):
    red = png((255, 0, 0))
    (tmp_path / "red.png").write_bytes(red)
    assert read_image(str(tmp_path / "red.png")) == red
    assert read_image("data:image/png;base64," + base64.b64encode(red).decode()) == red
    (tmp_path / "text.png").write_text("not an image")
    for source in (str(tmp_path / "missing.png"), str(tmp_path / "text.png"), "data:image/png;base64,@@",
                   "data:image/png," + red.hex()):
        with pytest.raises(InvalidConversation, match="unreadable_image"):
            read_image(source)


def test_placeholders_expand_with_mask_0_and_the_prompt_moves_with_them():
    ids, mask = [1, PAD, 2, PAD, 3, 4], [0, 0, 0, 0, 0, 1]
    images = [png((255, 0, 0)), png((0, 0, 255))]
    (ids, mask), prompt_len, kept = _expand_images(FixedVision(3), images, (ids, mask), prompt_len=5, max_len=99)
    assert ids == [1, PAD, PAD, PAD, 2, PAD, PAD, PAD, 3, 4] and mask == [0] * 9 + [1]
    assert prompt_len == 9 and kept == images


def test_a_cut_inside_an_image_skips_the_sample_and_images_past_the_cut_are_dropped():
    ids, images = [1, PAD, 2, PAD, 3], [png((255, 0, 0)), png((0, 0, 255))]
    with pytest.raises(InvalidConversation, match="image_cut_by_max_seq_len"):
        _expand_images(FixedVision(3), images, (ids,), prompt_len=5, max_len=6)
    (kept_ids,), _, kept = _expand_images(FixedVision(3), images, (ids,), prompt_len=5, max_len=5)
    assert kept == images[:1] and kept_ids[:5] == [1, PAD, PAD, PAD, 2]
    with pytest.raises(InvalidConversation, match="image_placeholders_mismatch"):
        _expand_images(FixedVision(3), images[:1], (ids,), prompt_len=5, max_len=99)


def test_a_request_collapses_each_image_run_to_the_templates_one_placeholder():
    images = [png((255, 0, 0)), png((0, 0, 255))]
    sent = request([1, PAD, PAD, PAD, 2, PAD, PAD, 3], images, FixedVision(3))
    assert sent["prompt_token_ids"] == [1, PAD, 2, PAD, 3]
    assert [item["type"] for item in sent["multi_modal_data"]["vision_chunk"]] == ["image", "image"]
    assert request([1, PAD, 2], images[:1], FixedVision(3), expanded=False)["prompt_token_ids"] == [1, PAD, 2]
    assert request([1, 2], [], None) == {"prompt_token_ids": [1, 2]}
