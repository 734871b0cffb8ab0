"""Stage 03: choose the draft vocabulary (the `draft.draft_vocab_size` most frequent loss-masked tokens).

Reads:  <run_dir>/01_data/token_freq.safetensors (counts of loss-masked train tokens over the target vocab).
Writes: <run_dir>/03_vocab/  vocab.safetensors (d2t int64 offsets, target_id = draft_id + d2t[draft_id];
        t2d bool over the target vocab), d2t.npy and t2d.npy (speculators' format), manifest.json (coverage).

    python 03_build_vocab_map.py --config configs/demo.yaml
    python 03_build_vocab_map.py --config configs/kimi_k25.yaml --set draft.draft_vocab_size=32000 --force
"""

from eagle3_pipeline import vocab
from eagle3_pipeline.cli import run_stage, stage_parser

if __name__ == "__main__":
    parser = stage_parser(__doc__)
    run_stage(parser, lambda config, args: vocab.run(config, force=args.force))
