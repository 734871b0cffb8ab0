"""EAGLE-3 draft training for Kimi-K2.5: the logic behind the numbered stage scripts.

Shared modules: `config` (the typed run config), `stage_io` (the stage contract), `cli` (arguments and
exit codes), `engine` (vLLM on the target), `stand_ins` (locally built stand-in targets).
"""
