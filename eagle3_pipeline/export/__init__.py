"""Stage 05: the trained draft as folders vLLM serves.

    stage     the stage: a checkpoint -> one folder per format, model card, spec
    format    the export format: what a folder holds, the spec a config implies, reading a folder's spec
    serving   vLLM's serving command for a draft folder (05's model card and 06's report print it)
"""
