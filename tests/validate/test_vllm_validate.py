"""05 + 06 end to end in vLLM CPU: the demo draft is accepted and keeps SmolLM2's greedy outputs, and the serving
command 06 prints serves it through vLLM's OpenAI-compatible server (the tiny Kimi's draft is served in
tests/test_pipeline_tiny_kimi.py, at the end of its 01-06 run).

One engine start per setting: SmolLM2 with the draft (k=3) and without, then one server per export format; one
more for an EAGLE 3.1 draft (`draft.fc_norm` + `draft.norm_output`) trained briefly on the demo run's data.

    python -m pytest -m vllm tests/validate/test_vllm_validate.py -s     # -s prints the acceptance figures
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from eagle3_pipeline.stage_io import read_manifest
from eagle3_pipeline.train import loop
from tests.conftest import run_python
from tests.subprocess_site import without_speculators
from tests.validate.runs import DEMO_HELD_OUT, DEMO_SAMPLES, DEMO_TRAIN, DEMO_VALIDATE, demo_run, stand_in_config
from tests.validate.smollm2_inputs import humaneval_chats


# What a user changes before rerunning 06 alone after an out-of-memory error or on a busier machine: runtime knobs,
# stale for no stage (01-05 were made with the config's values)
RUNTIME_CHANGES = ("target.engine.gpu_memory_utilization=0.8", "capture.batch_size=3", "data.regenerate.chunk_size=5",
                   "train.num_workers=1", "train.log_every=3")


def export_and_validate(path, run_dir, vocab_maps: bool = True) -> dict:
    """05 in this environment, then 06 (static check and vLLM) where speculators cannot be imported, as in
    vLLM 0.16's environment, with RUNTIME_CHANGES."""
    for script, environment, changes in (("05_export.py", None, ()),
                                         ("06_validate.py", without_speculators(run_dir.parent / "site"), RUNTIME_CHANGES)):
        sets = [arg for change in changes for arg in ("--set", change)]
        result = run_python(script, "--config", str(path), *sets, timeout=900, env=environment)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads((run_dir / "06_validate" / "report.json").read_text())
    run = report["runs"][0]
    print(f"\n{run_dir}: mean acceptance length {report['mean_acceptance_length']:.3f} at k=3, per position "
          f"{[round(r, 3) for r in report['acceptance_per_position']]}, drafts {run['num_drafts']}, greedy "
          f"identical {report['greedy_identical_fraction']}, eval step-0 accuracy {report['eval_step0_accuracy']}")
    assert run["skipped_parameters"] == [] and run["ignored_tensors"] == (["t2d"] if vocab_maps else [])
    assert run["shared_from_target"] == ["model.embed_tokens.weight"]  # the draft's own lm_head is kept
    assert read_manifest(run_dir / "06_validate") is not None
    return report


@pytest.fixture(scope="module")
def validated_demo(tmp_path_factory):
    """The cached demo run, exported and validated once for the tests below: (config, report.json)."""
    tmp_path = tmp_path_factory.mktemp("demo")
    config, path = demo_run(tmp_path)
    return config, export_and_validate(path, config.run_dir)


@pytest.mark.vllm
def test_demo_draft_is_accepted_and_keeps_smollm2s_greedy_outputs(validated_demo):
    """What the draft does on this CPU: drafts accepted, greedy outputs unchanged but for bf16 near-ties (vLLM
    CPU's bf16 kernels, AMX where the processor has it, round a k+1-token verifying step otherwise than a decode
    step; each changed output is one where the target's own logit margin is at most validate.max_tie_margin).
    Not a speed-up: with two cores the run with the draft is slower; the speed-up is reported, not asserted."""
    config, report = validated_demo
    assert report["num_speculative_tokens"] == 3 and len(report["acceptance_per_position"]) == 3
    assert report["mean_acceptance_length"] > 1.5
    divergences = report["runs"][0]["divergences"]
    assert report["verdict"] == "PASSED" and report["greedy_identical_fraction"] >= 0.5
    assert (divergences == []) == (report["greedy_identical_fraction"] == 1.0)
    assert all(d["margin_exact"] and abs(d["margin"]) <= config.validate_.max_tie_margin for d in divergences)
    assert report["runs"][0]["speedup"] > 0
    assert (config.run_dir / "06_validate" / "acceptance.png").stat().st_size > 10_000
    assert report["serving_command"] in (config.run_dir / "06_validate" / "report.md").read_text()


@pytest.mark.vllm
def test_speed_phases_and_the_draft_rounds_vllm_counted(validated_demo):
    """06's speed section from the engines: both phases timed; at concurrency 1 the step timer saw one drafting
    round in each decode step and each verifying step vLLM counted was one of them (a request's last round goes
    unverified; with asynchronous scheduling one more: the tiny Kimi on vLLM CPU left 2 over 2 requests, SmolLM2 on
    the H200 under MRv2 25 over 16); the model's parts are each measured and its cycle lies within the measured
    engine step and the rest."""
    config, report = validated_demo
    speed = report["runs"][0]["speed"]
    batch, single = speed["eval_batch"], speed["by_concurrency"]["1"]
    assert batch["with_draft"]["requests"] == batch["without_draft"]["requests"] == report["prompts"]
    assert batch["with_draft"]["latency_s_p50"] > 0 and batch["measured_speedup"] == report["runs"][0]["speedup"]
    requests = single["with_draft"]["requests"]
    assert requests == single["without_draft"]["requests"] == min(config.validate_.latency_prompts, report["prompts"])
    # one request a group: its decode steps are its verifying steps, vLLM's draft counter
    assert single["decode_steps"] == single["num_drafts"]
    assert single["num_drafts"] - requests <= single["draft_rounds_timed"] <= single["num_drafts"] + 2 * requests
    assert single["engine_steps_timed"] == single["draft_rounds_timed"]
    for phase in (batch, single):
        parts = [phase[name] for name in ("target_step_ms", "verify_forward_ms", "draft_step_ms", "sample_ms")]
        assert all(part > 0 for part in parts) and phase["fixed_ms"] > 0 and phase["predicted_speedup"] > 0
        assert phase["first_draft_round_ms"] > 0  # the draft's round in each group's prefill step
        assert 0 < phase["engine_step_ms"] <= phase["cycle_ms"]
        print(f"\nspeed, up to {phase['with_draft']['concurrency']} requests at once: model cycle "
              f"{phase['model_cycle_ms']:.2f} "
              f"ms, measured {phase['cycle_ms']:.2f} ms; speed-up predicted {phase['predicted_speedup']:.3f}, "
              f"measured {phase['measured_speedup']:.3f}")


def acceptance_length_standard_error(acceptance_per_position: list[float], num_drafts: int) -> float:
    """The standard error of a mean acceptance length measured over `num_drafts` drafts: a draft accepts X tokens,
    P(X >= i) is position i's acceptance rate, so E[X] = sum p_i and E[X^2] = sum (2i - 1) p_i."""
    mean = sum(acceptance_per_position)
    square = sum((2 * i - 1) * p for i, p in enumerate(acceptance_per_position, start=1))
    return math.sqrt((square - mean**2) / num_drafts)


def test_the_standard_error_of_an_acceptance_length():
    # drafts accepting 0, 1, 2 or 3 tokens, one each: X has mean 1.5 and variance 1.25
    assert acceptance_length_standard_error([0.75, 0.5, 0.25], 4) == pytest.approx(math.sqrt(1.25 / 4))


@pytest.mark.vllm
def test_04s_simulated_acceptance_predicts_vllms_within_3_percent_or_its_sampling_error(validated_demo):
    """04's eval replays greedy chain drafting on the held-out answers (train/acceptance.py); vLLM measures it on
    the text it generates. Where that is the held-out text the two agree closely (+0.3% on a processor without
    AMX); where vLLM CPU's bf16 kernels flip a near-tie (AMX rounds a k+1-token verifying step otherwise than a
    decode step), the rest of that answer is other text, and the demo's few hundred drafts measure it within
    their sampling error (two standard errors, about 6% here): the bound is whichever is larger."""
    config, report = validated_demo
    run = report["runs"][0]
    simulated, measured = run["simulated_mean_acceptance_length"], run["mean_acceptance_length"]
    error = acceptance_length_standard_error(run["acceptance_per_position"], run["num_drafts"])
    print(f"\nk=3: simulated {simulated:.4f}, vLLM {measured:.4f} ({(simulated - measured) / measured:+.2%}, "
          f"standard error {error:.4f} over {run['num_drafts']} drafts); per position vLLM "
          f"{[round(r, 3) for r in run['acceptance_per_position']]}, simulated "
          f"{report['by_source']['fabricated']['runs'][0]['simulated_acceptance_per_position']}")
    assert abs(simulated - measured) <= max(0.03 * measured, 2 * error)
    per_source = report["by_source"]["fabricated"]
    assert per_source["prompts"] == DEMO_HELD_OUT and per_source["runs"][0]["mean_acceptance_length"] == measured
    table = (config.run_dir / "06_validate" / "report.md").read_text()
    assert f"| 3 | vLLM, pooled | {measured:.3f} | {measured:.3f} |" in table
    assert f"| 3 | 04 simulated | {simulated:.3f} |" in table


# EAGLE 3.1 on the demo run's 01-03: a few steps from scratch (the plain draft's 04 is replaced), then 05 and a short 06
EAGLE31 = {"fc_norm": True, "norm_output": True}
FEW_STEPS = {"max_steps": 24, "eval_every": 24, "checkpoint_every": 24}
EAGLE31_TRAIN = {"standardize_aux": False, **FEW_STEPS}
SHORT_VALIDATE = {"max_prompts": 4, "max_tokens": 16, "latency_prompts": 0, "compare_without_speculation": False}


@pytest.mark.vllm
def test_an_eagle31_draft_is_loaded_whole_and_accepted(tmp_path):
    """06 serves an EAGLE 3.1 export and passes as the plain layout does (export_and_validate: exit 0, nothing
    skipped); its weights probe saw vLLM load every fc_norm tensor (a missing one runs at ones without a word,
    tests/export/test_vllm_draft_forward.py), and drafts were accepted."""
    demo_run(tmp_path)
    config, path = stand_in_config(tmp_path, "demo", DEMO_TRAIN | EAGLE31_TRAIN, DEMO_VALIDATE | SHORT_VALIDATE,
                                   draft=EAGLE31)
    loop.run(config, force=True)
    report = export_and_validate(path, config.run_dir)
    run = report["runs"][0]
    assert report["verdict"] == "PASSED" and report["problems"] == []
    assert {f"model.fc_norm.{i}.weight" for i in range(3)} <= set(run["loaded_parameters"])
    assert run["num_drafts"] > 0 and report["mean_acceptance_length"] > 1


@pytest.mark.vllm
def test_a_draft_over_the_whole_vocabulary_is_loaded_without_maps_and_accepted(tmp_path):
    """draft.draft_vocab_size = SmolLM2's 49,152 on the demo run's 01-02 (03 rebuilt, a few steps of 04 from
    scratch): the export holds no d2t or t2d, vLLM builds no draft-to-target map, loads every tensor and accepts
    drafts."""
    from eagle3_pipeline import vocab

    demo_run(tmp_path)
    config, path = stand_in_config(tmp_path, "demo", DEMO_TRAIN | FEW_STEPS, DEMO_VALIDATE | SHORT_VALIDATE,
                                   draft={"draft_vocab_size": 49152})  # SmolLM2's vocabulary
    vocab.run(config, force=True)
    loop.run(config, force=True)
    report = export_and_validate(path, config.run_dir, vocab_maps=False)
    assert report["verdict"] == "PASSED" and report["problems"] == []
    assert report["runs"][0]["num_drafts"] > 0 and report["mean_acceptance_length"] > 1


# The printed serving command, run as a user pastes it: a few held-out prompts through the openai client.
SERVER_START_TIMEOUT_S = 300  # SmolLM2 with the draft starts in about a minute on 2 busy cores
CHAT_PROMPTS, CHAT_MAX_TOKENS = 3, 24


@pytest.mark.vllm
@pytest.mark.parametrize("fmt", ["reference", "speculators"])
def test_printed_serving_command_serves_the_draft(validated_demo, fmt, tmp_path):
    """06 serves and reports the first exported format (reference); the other one's command is its model card's."""
    import openai

    config, report = validated_demo
    export_dir = config.run_dir / "05_export" / fmt
    card_command = (export_dir / "README.md").read_text().split("## Serving\n```\n")[1].split("\n```")[0]
    command = card_command
    if export_dir == Path(report["export"]):  # the format 06 served: its report and the card print one command,
        command = report["serving_command"]  # with the memory share 06 ran with (RUNTIME_CHANGES) in 06's
        assert command == re.sub(r"--gpu-memory-utilization \S+", "--gpu-memory-utilization 0.8", card_command)
        assert "--gpu-memory-utilization 0.8" in command
    assert str(export_dir) in command
    with openai_server(command, tmp_path / "server.log") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
        model = client.models.list().data[0].id
        for messages in humaneval_chats(DEMO_SAMPLES)[-DEMO_HELD_OUT:][:CHAT_PROMPTS]:
            reply = client.chat.completions.create(model=model, messages=messages, max_tokens=CHAT_MAX_TOKENS,
                                                   temperature=0.0)
            assert reply.choices[0].message.content.strip(), reply
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
            metrics = spec_decode_counters(response.read().decode())
    print(f"\n{fmt}: {metrics}, mean acceptance length {1 + metrics['accepted'] / max(metrics['drafts'], 1):.3f}")
    assert metrics["drafts"] > 0 and metrics["accepted"] > 0


@contextlib.contextmanager
def openai_server(command: str, log_path: Path) -> Iterator[str]:
    """`command` run by bash with `--host 127.0.0.1 --port <free port>` appended (vLLM's parser keeps an
    option's last value, so these win over any host or port in the command); yields the server's URL once
    /health answers. The server and its engine process share a new process group, killed on the way out."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        server = subprocess.Popen(["bash", "-c", f"{command} --host 127.0.0.1 --port {port}"], stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not healthy(url):
            if server.poll() is not None:
                pytest.fail(f"the server exited with {server.returncode}:\n{log_tail(log_path)}")
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not answer /health in {SERVER_START_TIMEOUT_S} s:\n{log_tail(log_path)}")
            time.sleep(2)
        yield url
    finally:
        stop(server)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (vLLM shuts its engine down), then SIGKILL to whatever is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):  # an engine process that outlived the server, or a hung server
        os.killpg(server.pid, signal.SIGKILL)
    server.wait()


def log_tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def spec_decode_counters(text: str) -> dict[str, float]:
    """vLLM's spec-decode counters in a /metrics page, summed over their label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {"vllm:spec_decode_num_drafts_total": "drafts", "vllm:spec_decode_num_accepted_tokens_total": "accepted"}
    counters = dict.fromkeys(names.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                counters[names[sample.name]] += sample.value
    return counters
