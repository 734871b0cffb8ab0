"""Stage 05: export the trained draft as folders vLLM serves, with a model card and a spec of every tensor.

Reads:  <run_dir>/04_train/ (the last checkpoint, or --checkpoint step_N; metrics.jsonl for the model card),
        the target's config.json (vocab size, layer count, bos/eos ids; or `export.target_facts`).
Writes: <run_dir>/05_export/  reference/ (config.json as AQ-MedAI/Kimi-K25-eagle3, model.safetensors with
        midlayer.* names, bf16), speculators/ (speculators config, same tensors), each with README.md and
        spec.json; manifest.json.

    python 05_export.py --config configs/demo.yaml
    python 05_export.py --config configs/demo.yaml --checkpoint step_16 --force
    python 05_export.py --config configs/kimi_k25.yaml --spec-only      # shapes only: no weights, no stages
    python 06_validate.py --config configs/kimi_k25.yaml --check runs/kimi_k25/05_export/spec.json \
        --reference eagle3_pipeline/reference/aq_medai_kimi_k25_eagle3.json
"""

from pathlib import Path

from eagle3_pipeline.cli import run_stage, stage_parser
from eagle3_pipeline.export import stage

if __name__ == "__main__":
    parser = stage_parser(__doc__)
    parser.add_argument("--checkpoint", metavar="step_N", help="export this checkpoint of 04_train (default: the last)")
    parser.add_argument("--spec-only", action="store_true",
                        help="write only spec.json, from the config alone (draft built on the meta device)")
    parser.add_argument("--out", type=Path, help="--spec-only: the file to write (default <run_dir>/05_export/spec.json)")

    def run(config, args):
        if args.spec_only:
            stage.write_spec_only(config, args.out)
        else:
            stage.run(config, force=args.force, checkpoint=args.checkpoint)

    run_stage(parser, run)
