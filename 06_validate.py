"""Stage 06: check the export against its spec, then serve it in vLLM and measure the acceptance.

Reads:  <run_dir>/05_export/ (every exported format), <run_dir>/01_data/eval (prompt_ids: the templated eval
        prompts), the target (vLLM engine settings from the config).
Writes: <run_dir>/06_validate/  report.json (mean_acceptance_length, acceptance_per_position,
        greedy_identical_fraction, static_differences, ...), report.md, acceptance.png; manifest.json only
        when every check passed. Exit 1 on a breaking difference, a skipped draft tensor or a train/serve mismatch.

    python 06_validate.py --config configs/demo.yaml
    # static check only, of any export folder or spec.json (against the config's spec, or a reference):
    python 06_validate.py --config configs/kimi_k25.yaml --check runs/kimi_k25/05_export/spec.json
    python 06_validate.py --config configs/kimi_k25.yaml --check runs/kimi_k25/05_export/reference \
        --reference /models/Kimi-K25-eagle3      # a downloaded AQ-MedAI/Kimi-K25-eagle3 (or its spec json)
"""

from pathlib import Path

from eagle3_pipeline.cli import run_stage, stage_parser
from eagle3_pipeline.validate import stage

if __name__ == "__main__":  # vLLM spawns its engine process: the guard keeps it from rerunning this script
    parser = stage_parser(__doc__)
    parser.add_argument("--check", type=Path, metavar="PATH",
                        help="static check only of this export folder or spec.json (default with --reference: the run's export)")
    parser.add_argument("--reference", type=Path, metavar="DIR",
                        help="static check only, against this reference checkpoint folder or spec json instead of the config")

    def run(config, args):
        if args.check or args.reference:
            stage.check(config, args.check, args.reference)
        else:
            stage.run(config, force=args.force)

    run_stage(parser, run)
