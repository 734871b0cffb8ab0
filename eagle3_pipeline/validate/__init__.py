"""Stage 06: the export checked against its spec, served by vLLM with the target, its acceptance and speed measured.

    stage            the stage: static check, vLLM runs, problems, report
    compare          an export against its spec, each difference classified by what vLLM makes of it
    acceptance       vLLM with and without the draft: counters, loaded weights, greedy outputs and divergences
    request_steps    each request's own acceptance length from the tokens vLLM emits per engine step
    speed            decode speed with and without the draft, step costs, the predicted speed-up
    worker           the worker extension of 06's engines with a draft
    weights_probe    which draft parameters vLLM's loader filled
    report           report.json, report.md, acceptance.png, terminal tables
"""
