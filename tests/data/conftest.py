"""The tiny Kimi's chat template in thinking and instant mode, for the tests of Kimi's agentic records."""

from __future__ import annotations

import pytest

from eagle3_pipeline.data.chat_template import ChatTemplate, load_tokenizer


@pytest.fixture(scope="module", params=[True, False], ids=["thinking", "instant"])
def kimi(request, tiny_kimi_dir) -> ChatTemplate:
    return ChatTemplate(load_tokenizer(tiny_kimi_dir, trust_remote_code=False), {"thinking": request.param})
