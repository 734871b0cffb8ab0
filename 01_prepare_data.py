"""Stage 01: build the training and eval datasets from conversations, answered by the target itself.

Reads:  the sources in the config's `data:` section (Hugging Face datasets, local JSON/JSONL/Parquet files,
        HumanEval prompts, magpie synthesis) and the target (tokenizer, chat template; vLLM when it writes).
Writes: <run_dir>/01_data/  train/ and eval/ (Arrow: id, source, input_ids, loss_mask, seq_len; eval adds
        prompt_ids), token_freq.safetensors, stats.json, generated/ (resumable chunks), manifest.json.

    python 01_prepare_data.py --config configs/demo.yaml
    python 01_prepare_data.py --config configs/demo.yaml --set data.regenerate.max_tokens=64 --force

Killed midway, the same command resumes: finished generation chunks are kept.
"""

from eagle3_pipeline.cli import run_stage, stage_parser
from eagle3_pipeline.data import stage

if __name__ == "__main__":  # vLLM spawns its engine process: the guard keeps it from rerunning this script
    parser = stage_parser(__doc__)
    run_stage(parser, lambda config, args: stage.run(config, force=args.force))
