"""Stage 04: train the EAGLE-3 draft with training-time test (TTT) on the captured hidden states.

Reads:  <run_dir>/01_data/ (token ids, loss masks), 02_hidden_states/ (aux + final states), 03_vocab/ (d2t,
        t2d), and embed_tokens, final norm and lm_head of the target checkpoint (only those three tensors).
Writes: <run_dir>/04_train/  checkpoints/step_N/ (model.safetensors, optimizer, scheduler, RNG, data
        position), metrics.jsonl, tensorboard/, curves.png, manifest.json (final eval accuracy per TTT step).

    python 04_train.py --config configs/demo.yaml                          # CPU or one GPU
    accelerate launch --num_processes 8 04_train.py --config configs/kimi_k25.yaml   # 8 GPUs, DDP
    torchrun --nproc_per_node 2 04_train.py --config configs/demo.yaml     # 2 CPU processes (gloo)
    python 04_train.py --config configs/demo.yaml --resume                 # continue from the last checkpoint
    tensorboard --logdir runs/demo/04_train/tensorboard

With capture.mode stream, start it beside 02, which feeds it while it trains (docs/stream.md).
"""

from eagle3_pipeline.cli import run_stage, stage_parser
from eagle3_pipeline.train import loop

if __name__ == "__main__":
    parser = stage_parser(__doc__)
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in 04_train/")
    parser.add_argument("--stop-at-step", type=int, metavar="N",
                        help="checkpoint and exit after step N, unfinished (split a run across time-limited jobs)")
    run_stage(parser, lambda config, args: loop.run(config, resume=args.resume, force=args.force,
                                                    stop_at_step=args.stop_at_step))
