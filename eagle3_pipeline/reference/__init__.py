"""Facts the pipeline checks itself against, shipped with it.

- `aq_medai_kimi_k25_eagle3.json`: the public EAGLE-3 draft for Kimi-K2.5 (AQ-MedAI/Kimi-K25-eagle3):
  its config and every tensor's shape and dtype. The Kimi export must match it.
- `kimi_k25_target.json`: the target's facts the production config depends on.
"""

from pathlib import Path

REFERENCE_DIR = Path(__file__).resolve().parent
REFERENCE_DRAFT_SPEC = REFERENCE_DIR / "aq_medai_kimi_k25_eagle3.json"
KIMI_K25_TARGET = REFERENCE_DIR / "kimi_k25_target.json"
