"""Stage 02: the target's hidden states, captured through vLLM, stored in shards or streamed to 04.

    stage              the stage: shards, jobs, the stream's eval part, the manifest
    engine             the two capture paths on a vLLM engine (extract_hidden_states, the worker extension)
    worker             the vLLM worker extension that records the aux and final states per step (either runner)
    store              the shard format and its reader (04 reads the states through it)
    stream             stream mode: the window, the Transport interface and the registry of transports
    stream_directory   the transport through a folder both sides see
    stream_mooncake    the transport through a Mooncake store's memory
"""
