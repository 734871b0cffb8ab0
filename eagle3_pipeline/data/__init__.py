"""Stage 01: chats (and the target's own answers) -> a templated, tokenized, assistant-only loss-masked dataset.

    stage           the stage: sources -> conversations -> rows, the eval split, the manifest
    sources         where conversations come from: datasets, local files, benchmark prompts from wheels
    conversations   every schema read into one conversation shape; reasoning, tool calls, images; skips
    bfcl            BFCL v4 function-calling records as OpenAI records
    generate        turns the target writes through vLLM: magpie user turns, regenerated answers
    chat_template   the target's chat template -> token ids with the assistant-only loss mask
    samples         conversations -> dataset rows (one per conversation or per assistant turn)
    vision          images expanded exactly as vLLM expands them
    stats           stats.json, and the token counts 03 builds the vocabulary from
    dataset         reading a finished 01_data (02, 03, 04, 06 and the benches)
"""
