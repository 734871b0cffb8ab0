"""Stage 02: the target's hidden states, captured through vLLM, stored in shards or streamed to 04.

    stage              the stage: shards, jobs, the stream's eval part, the manifest
    engine             the two capture paths on a vLLM engine (extract_hidden_states, the worker extension)
    worker             the vLLM worker extension that records the aux and final states per step (either runner)
    handover           how the worker hands the states to the main process (mapped slabs or safetensors files)
    store              the shard format and its reader (04 reads the states through it)
    stream             stream mode: the Transport interface, its registry, the items, waiting, 04's side
    stream_producer    stream mode: a capture job's side, within its share of the window
    stream_directory   the transport through a folder both sides see
    stream_mooncake    the transport through a Mooncake store's memory
"""
