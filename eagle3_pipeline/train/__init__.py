"""Stage 04: train the EAGLE-3 draft on the target's captured hidden states with training-time test (TTT).

    loop         the stage, top to bottom: setup, the training loop, evaluation, the manifest
    inputs       01's splits, 02's states or stream, 03's vocabulary: opened, checked, planned into packs
    draft_model  the draft (speculators' Eagle3DraftModel + our TTT forward and loss)
    mla          draft.attention mla: the MLA decoder layer (DeepSeek-V3's) registered with speculators
    attention    the TTT attention masks: document-aware causal, plus each row's own entry per extra step
    verifier     the target's embed_tokens, final norm and lm_head, read by name from its checkpoint
    data         samples shifted by one token and packed into rows, per rank (the pack plan: pack_plan.py)
    step         one optimizer step, the optimizer and the schedule (shared with bench/train_throughput.py)
    checkpoint   atomic checkpoints: model, optimizer, scheduler, RNG, data position
    metrics      loss/accuracy per TTT step: metrics.jsonl, TensorBoard, curves.png; the eval summary 05 reuses
    flops        the FLOP count of a step, peak FLOP/s of known GPUs, hence MFU
    loss         the distillation loss of a TTT step (train.loss), and the head fused with it, chunked
    acceptance   acceptance length without an engine: greedy chain drafting replayed on the target's answers
"""
