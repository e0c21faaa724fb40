"""Tensor-parallel targets (`--tp` under torchrun; `opttree.parallel`, `opttree.server.ranks`): the shipped
target sharded over 2 CPU ranks (gloo) gives plain decoding's greedy tokens through the library, the
CLI, bench and the server; seeded sampling is the same on every rank; ranks that part ways say so; a
rank that dies takes the others down instead of leaving them waiting."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import torch
from transformers import GPT2Config, LlamaConfig

import opttree
from opttree import parallel
from opttree.cli import main

HERE = Path(__file__).parent
PROMPT = "def fibonacci(n):\n"


def torchrun(*args: str, **popen) -> subprocess.Popen:
    """`torchrun --standalone --nproc-per-node 2 ARGS` (a free rendezvous port each time), one thread a rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPTTREE_AUTO_CALIBRATE": "0"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    return subprocess.Popen(command, env=env, text=True, start_new_session=True, **popen)


def kill_all(launcher: subprocess.Popen) -> None:
    """torchrun and its ranks (a session of their own), if still there."""
    if launcher.poll() is None:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


def run_to_end(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = torchrun(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def rank_process(launcher: subprocess.Popen, rank: int, timeout: float = 120) -> psutil.Process:
    """The worker process torchrun started for `rank`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(launcher.pid).children(recursive=True):
            try:
                if child.environ().get("RANK") == str(rank) and "opttree" in " ".join(child.cmdline()):
                    return child
            except psutil.Error:
                continue
        time.sleep(0.2)
    raise AssertionError(f"torchrun started no rank {rank}")


@pytest.fixture(scope="module")
def pair():
    return opttree.demo_models(torch.float32)


def greedy_reference(pair, prompt: str, n: int) -> list[int]:
    target, _, tok = pair
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.inference_mode():
        out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
    return out[0, ids.shape[1]:].tolist()


# ---- without torchrun -------------------------------------------------------------------------------


def test_tp_outside_torchrun_says_how_to_launch(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["generate", "--tp", "--prompt", "x", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "torchrun --nproc-per-node K -m opttree" in err and "Traceback" not in err


def test_tp_refuses_what_a_sharded_target_cannot_take(capsys):
    assert main(["generate", "--tp", "--quantize", "int8", "--prompt", "x"]) == 2
    assert "--tp does not combine with --quantize" in capsys.readouterr().err


def test_architectures_without_a_tensor_parallel_plan_are_refused():
    with pytest.raises(ValueError, match="'gpt2' model, for which transformers has no tensor-parallel plan"):
        parallel.check_plan(GPT2Config(), "models/gpt2")
    parallel.check_plan(LlamaConfig(), "models/llama")  # has one: no error


# ---- under torchrun, 2 CPU ranks --------------------------------------------------------------------


def test_sharded_target_is_exact_for_every_draft_and_the_ranks_agree(tmp_path):
    run_to_end(str(HERE / "tp_worker.py"), str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for seen in ranks:
        assert seen["sharded"]  # the target's weights really are split over the ranks
        assert len(seen["greedy"]) == 8
        for key, tokens in seen["greedy"].items():  # ar, opt with the draft, recycling+lookup, the head
            assert tokens == seen["reference"][key.split("/")[1]], key
        assert "tensor-parallel ranks diverged at step " in (seen["diverged"] or "")  # every rank raised, none hung
    assert ranks[0]["sampled"] == ranks[1]["sampled"] and len(ranks[0]["sampled"]) == 40


def test_generate_and_bench_commands_speak_on_rank_0_only(pair, tmp_path):
    out = run_to_end("-m", "opttree", "generate", "--tp", "--dtype", "float32", "--json", "--prompt", PROMPT,
                     "--max-new-tokens", "32")
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout  # one rank printed
    assert json.loads(lines[0])["token_ids"] == greedy_reference(pair, PROMPT, 32)

    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPT + "\n")
    out = run_to_end("-m", "opttree", "bench", "--tp", "--dtype", "float32", "--prompts", str(prompts),
                     "--methods", "ar,opt:recycling+lookup,hf-ar", "--budgets", "4", "--max-new-tokens", "16",
                     "--no-progress", "--json", "--out", str(tmp_path / "bench"))
    rows = [json.loads(line) for line in out.stdout.strip().splitlines()]
    assert len(rows) == 1 and {r["method"] for r in rows[0]} == {"ar", "opt:recycling+lookup", "hf-ar"}
    assert all(r["mismatches"] == 0 for r in rows[0])
    records = json.loads((tmp_path / "bench" / "results.json").read_text())["records"]
    assert {r["label"] for r in records} == {"ar", "opt:recycling+lookup@4", "hf-ar"}
    assert not any(r["mismatch"] for r in records)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sharded_server_answers_the_openai_client_and_stops_cleanly(pair, tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    server = torchrun("-m", "opttree", "serve", "--tp", "--dtype", "float32", "--port", str(port),
                      stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        _, _, tok = pair
        expected = tok.decode(greedy_reference(pair, PROMPT, 24), skip_special_tokens=True)
        assert client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text == expected
        scored = client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=0, logprobs=2).choices[0]
        assert "".join(scored.logprobs.tokens) == scored.text == expected  # rank 0's row keeps its logits
        assert all(max(top.values()) == lp for top, lp in zip(scored.logprobs.top_logprobs, scored.logprobs.token_logprobs))
        stream = client.completions.create(model="m", prompt="import os\n", max_tokens=200, temperature=0, stream=True)
        next(iter(stream))
        stream.close()  # abandoned: every rank drops the generation, and the next request is served
        with pytest.raises(openai.BadRequestError, match="budget"):
            client.completions.create(model="m", prompt=PROMPT, max_tokens=4, extra_body={"budget": 0})
        seeded = [client.completions.create(model="m", prompt=PROMPT, max_tokens=16, temperature=1, seed=5).choices[0].text
                  for _ in range(2)]
        assert seeded[0] == seeded[1]
        two = client.completions.create(model="m", prompt=PROMPT, max_tokens=16, temperature=1, seed=5, n=2).choices
        assert two[0].text == seeded[0] != two[1].text  # choice i seeded with seed + i, each in its turn
        assert client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text == expected
        rank_process(server, 0).send_signal(signal.SIGTERM)  # rank 0 shuts down and releases the others
        assert server.wait(timeout=120) == 0, (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        kill_all(server)


def test_a_rank_killed_mid_generation_ends_the_others_with_an_error(tmp_path):
    proc = torchrun("-m", "opttree", "generate", "--tp", "--dtype", "float32", "--tree", "ar", "--prompt", PROMPT,
                    "--max-new-tokens", "1500", stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout.read(len(PROMPT) + 8)  # rank 0 is streaming tokens: the ranks are mid-generation
        victim = rank_process(proc, 1)
        survivor = rank_process(proc, 0)
        victim.kill()
        assert proc.wait(timeout=120) != 0  # torchrun reports the failure ...
        assert not survivor.is_running() or survivor.status() == psutil.STATUS_ZOMBIE  # ... and rank 0 is gone
    finally:
        kill_all(proc)
