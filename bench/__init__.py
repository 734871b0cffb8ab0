"""The benchmarks: each a module run from the project's root as `python -m bench.NAME` (bench/README.md lists
each bench's question, hardware, output, latest result and command, and the retired ones).

    harness              what they share: a command line, a phase clock, logged stage runs, cached and saved results
    report               rendering saved results into markdown and plots
    draft_eval           one teacher-forced evaluator for any speculators-format draft (04's own unroll)
    quality              draft quality on CPU: our trainer against speculators' (SmolLM2 stand-in)
    quality_gpu          draft quality at scale on one GPU: learning curve, levers, seeds, regeneration
    speculators_trainer  speculators' own trainer on our stage outputs (used by both quality benches)
    gpu_pipeline         every stage on a GPU node, per stand-in, capture path and model runner
    capture_overhead     02's capture against the same engine's plain prefill
    handover_read        02's main process reading the worker extension's states out of the mapped slabs
    stream               stream mode against offline on one machine
    stream_items         one stream item's host cost per side: 02's encode and put, 04's get, check and decode
    stream_handoff       the stream's hand-over alone at a GPU run's pace (the GPU's work as sleeps or products)
    speed_model          06's speed model against the speed-up vLLM measures, run again and again or read from reports
    kimi_speedup         the speed-up 06's model predicts for Kimi-K2.5 from bytes and GPU 06 reports' host parts
    train_throughput     04's step at the Kimi draft's shape against speculators' step
    train_scaling        04 on several GPUs against one: curves, tokens/s per GPU, cross-count resume
"""
