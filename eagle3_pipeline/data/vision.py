"""Images in the target's prompts (stages 01, 02 and 06), expanded exactly as vLLM expands them.

The chat template writes one placeholder token per image (Kimi-K2.5: `<|media_pad|>` inside
`<|media_begin|>image<|media_content|>...<|media_end|>`); vLLM's multimodal processor replaces it with one copy
per embedding the vision encoder makes of the image (Kimi: one per 2x2 merged 14-pixel patches). Stage 01
stores the prompt expanded the same way, counted by vLLM's own processor for the target (built from the
target's folder, without an engine), so that a sample's ids, its loss mask (0 on every image token) and the
rows 02 captures line up one to one; it stores each image's file bytes beside the ids. 02 and 06 give vLLM the
stored ids with each image's run of placeholders collapsed back to one token, plus the images; 02 checks
that the prompt vLLM expanded equals 01's ids.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from pathlib import Path
from typing import Any

from eagle3_pipeline.config_sections import TargetConfig
from eagle3_pipeline.data.conversations import InvalidConversation
from eagle3_pipeline.target import image_token_id

Prompt = tuple[list[int], list[bytes]]  # a sample's ids as 01 stores them, and its images' file bytes


def read_image(source: str) -> bytes:
    """The file bytes of an image named by a local path or a base64 `data:` URL (unreadable: skipped)."""
    if source.startswith("data:"):
        header, _, payload = source.partition(",")
        try:
            data = base64.b64decode(payload, validate=True) if header.endswith(";base64") else b""
        except binascii.Error:
            data = b""
    else:
        try:
            data = Path(source).read_bytes()
        except OSError:
            data = b""
    decode(data)
    return data


def decode(data: bytes):
    """An image file's bytes as an RGB PIL image."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError):
        raise InvalidConversation("unreadable_image") from None


class Vision:
    """The target's image inputs as vLLM's multimodal processor for it (`processor`) handles them."""

    def __init__(self, processor, token_id: int):
        self.processor = processor
        self.token_id = token_id
        # Kimi-K2.5 takes images as items of its "vision_chunk" modality; other models as "image"
        self.modality = "image" if "image" in processor.info.get_supported_mm_limits() else "vision_chunk"
        self._tokens: dict[str, int] = {}

    @classmethod
    def offline(cls, target: TargetConfig, model_dir: Path, token_id: int) -> Vision:
        """vLLM's processor for the target, from its folder (config, tokenizer, processor config): no engine."""
        from vllm.config import ModelConfig
        from vllm.multimodal import MULTIMODAL_REGISTRY

        config = ModelConfig(model=str(model_dir), trust_remote_code=target.trust_remote_code,
                             max_model_len=target.engine.max_model_len)
        return cls(MULTIMODAL_REGISTRY.create_processor(config), token_id)

    @classmethod
    def of_engine(cls, llm, model_dir: Path) -> Vision | None:
        """The processor of a running `vllm.LLM` on the target in `model_dir`; None for a text-only target."""
        token_id = image_token_id(model_dir)
        return None if token_id is None else cls(llm.renderer.get_mm_processor(), token_id)

    def data(self, images: list[bytes]) -> dict[str, list[Any]]:
        """`multi_modal_data` of a request with these images."""
        decoded = [decode(image) for image in images]
        if self.modality == "image":
            return {"image": decoded}
        return {"vision_chunk": [{"type": "image", "image": image, "uuid": None} for image in decoded]}

    def tokens(self, image: bytes) -> int:
        """How many placeholder tokens vLLM makes of this image's one."""
        key = hashlib.sha256(image).hexdigest()
        if key not in self._tokens:
            from vllm.multimodal.processing import TimingContext
            from vllm.multimodal.processing.inputs import ProcessorInputs

            inputs = ProcessorInputs(prompt=[self.token_id], mm_data_items=self.processor.info.parse_mm_data(
                self.data([image])))
            self._tokens[key] = len(self.processor.apply(inputs, TimingContext(enabled=False))["prompt_token_ids"])
        return self._tokens[key]

    def repeats(self, ids: list[int], images: list[bytes]) -> list[int]:
        """Per token of a templated (one placeholder per image) prompt: how many tokens it becomes in vLLM."""
        at = [i for i, token in enumerate(ids) if token == self.token_id]
        if len(at) != len(images):  # the template wrote other placeholders than the conversation's images
            raise InvalidConversation("image_placeholders_mismatch")
        counts = [1] * len(ids)
        for i, image in zip(at, images):
            counts[i] = self.tokens(image)
        return counts

    def request(self, ids: list[int], images: list[bytes], expanded: bool = True) -> dict[str, Any]:
        """A vLLM prompt of ids (as 01 stores them, `expanded`, or as the template writes them) and their images."""
        if expanded:
            ids = [t for i, t in enumerate(ids) if t != self.token_id or i == 0 or ids[i - 1] != self.token_id]
        return {"prompt_token_ids": ids, "multi_modal_data": self.data(images)}


def request(ids: list[int], images: list[bytes], vision: Vision | None, expanded: bool = True) -> dict[str, Any]:
    """A vLLM prompt (a `TokensPrompt` dict) of ids and their images, if any."""
    return vision.request(ids, images, expanded) if images else {"prompt_token_ids": list(ids)}
