"""Facts the pipeline checks itself against, shipped with it.

- `aq_medai_kimi_k25_eagle3.json`: the public EAGLE-3 draft for Kimi-K2.5 (AQ-MedAI/Kimi-K25-eagle3):
  its config and every tensor's shape and dtype. The Kimi export must match it.
"""

from pathlib import Path

REFERENCE_DRAFT_SPEC = Path(__file__).resolve().parent / "aq_medai_kimi_k25_eagle3.json"
