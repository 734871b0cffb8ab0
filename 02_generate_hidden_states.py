"""Stage 02: vLLM runs the target on every sample of stage 01 and stores its hidden states.

Reads  <run_dir>/01_data/ (train and eval splits)
Writes <run_dir>/02_hidden_states/: shard_NNNNN.safetensors (aux states [T, n_aux, H] + final [T, H] per
       sample, bf16 or fp8 with per-token scales), index.json (sample id -> shard, offset, length), manifest.json

    python 02_generate_hidden_states.py --config configs/demo.yaml
    # N independent jobs (one per node), each on its own shards; the last one to finish writes the index:
    python 02_generate_hidden_states.py --config configs/kimi_k25.yaml --shard-index $I --num-shards $N

A killed run resumes at the first shard that is not complete and verified.

Stream mode (capture.mode: stream): only the eval split goes into shards; the train split is captured in 04's
pack order into a bounded window while 04 trains (start both; docs/stream.md):

    python 02_generate_hidden_states.py --config configs/demo.yaml --set capture.mode=stream &
    python 04_train.py --config configs/demo.yaml --set capture.mode=stream
"""

from eagle3_pipeline.capture import stage
from eagle3_pipeline.cli import run_stage, stage_parser

if __name__ == "__main__":
    parser = stage_parser(__doc__)
    parser.add_argument("--shard-index", type=int, default=0, help="this job's number, 0..num-shards-1")
    parser.add_argument("--num-shards", type=int, default=1, help="independent jobs splitting the work")
    parser.add_argument("--ignore-disk-check", action="store_true", help="start even if free disk looks short")

    def run(config, args):
        if not 0 <= args.shard_index < args.num_shards:
            parser.error(f"--shard-index must be in 0..{args.num_shards - 1}")
        stage.run(config, force=args.force, shard_index=args.shard_index, num_shards=args.num_shards,
                    ignore_disk_check=args.ignore_disk_check)

    run_stage(parser, run)
