"""EAGLE-3 draft training for Kimi-K2.5: the logic behind the numbered stage scripts.

One package per stage (data 01, capture 02, train 04, export 05, validate 06; vocab 03 is one module), and the
modules every stage shares:

    config             the typed run config: load_config, overrides, knob kinds (output or runtime)
    config_sections    the config's sections, one class per YAML section
    config_reference   docs/config.md and the README's stage table, generated from the schema and STAGES
    stage_io           the stage contract: STAGES, folders, manifests, fingerprints, stale and partial work
    cli                the numbered scripts' command line and exit codes
    target             the target's folder and config.json facts
    engine             starting vLLM on the target (01, 02, 06)
    pack_plan          04's pack plan (02 streams in its order)
    acceptance         the acceptance-length counts and their metric keys (01, 04, 06, the benches)
    draft_spec         the draft's tensors, shapes and FLOPs, described once (04, 05, 06)
    vocab              stage 03: the draft vocabulary (d2t, t2d)
    plan               GPU-hours per stage for a config, before a run
    stand_ins          stand-in targets built locally
    reference          the public reference draft's spec, shipped with the package
    __main__           utility commands: stages, plan, stand-ins, config-reference
"""
