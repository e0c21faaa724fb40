"""`opttree serve` end to end: a real uvicorn server on a local port, the official `openai` client."""

import socket
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn

import opttree
from opttree.server.app import Server, create_app
from opttree.text import TextStream

TREE = dict(tree="opt", budget=4, delta=0.1)
PROMPT = "def fibonacci(n):\n"
CHAT_TEMPLATE = "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}def {% endif %}"


def start(server: Server) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=uv.run, daemon=True).start()
    for _ in range(200):
        if uv.started:
            return f"http://127.0.0.1:{port}"
        time.sleep(0.05)
    raise RuntimeError("the server did not start")


@pytest.fixture(scope="module")
def pair():
    return opttree.demo_models(torch.float32)


@pytest.fixture(scope="module")
def url(pair):
    target, draft, tok = pair
    return start(Server(target, draft, tok, TREE, model_name="demo"))


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def reference(pair, prompt_ids, n, **kw) -> list[int]:
    target, draft, _ = pair
    return opttree.generate(target, prompt_ids, draft, max_new_tokens=n, **TREE, **kw).new_tokens.tolist()


def test_completion_is_the_greedy_output(pair, client):
    target, _, tok = pair
    ids = tok(PROMPT, return_tensors="pt", add_special_tokens=False).input_ids
    out = client.completions.create(model="demo", prompt=PROMPT, max_tokens=24, temperature=0)
    with torch.inference_mode():
        hf = target.generate(ids, do_sample=False, max_new_tokens=24, attention_mask=torch.ones_like(ids))
    assert out.choices[0].text == tok.decode(hf[0, ids.shape[1]:], skip_special_tokens=True)
    assert out.choices[0].text == tok.decode(reference(pair, ids, 24), skip_special_tokens=True)
    assert out.usage.prompt_tokens == ids.shape[1] and out.usage.completion_tokens == 24
    assert out.choices[0].finish_reason == "length"


def test_streamed_completion_equals_the_whole(client):
    whole = client.completions.create(model="demo", prompt=PROMPT, max_tokens=32, temperature=0).choices[0].text
    parts = list(client.completions.create(model="demo", prompt=PROMPT, max_tokens=32, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == whole
    assert parts[-1].choices[0].finish_reason == "length"


def test_stop_sequences_end_the_text_before_them(client):
    whole = client.completions.create(model="demo", prompt=PROMPT, max_tokens=32, temperature=0).choices[0].text
    stop = whole[10:13]
    cut = whole[: whole.index(stop)]
    out = client.completions.create(model="demo", prompt=PROMPT, max_tokens=32, temperature=0, stop=stop)
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    parts = client.completions.create(model="demo", prompt=PROMPT, max_tokens=32, temperature=0, stop=[stop],
                                      stream=True)
    assert "".join(p.choices[0].text for p in parts) == cut


def test_seeds_reproduce_sampled_output(client):
    runs = [client.completions.create(model="demo", prompt=PROMPT, max_tokens=24, temperature=1.0, seed=s).choices[0].text
            for s in (3, 3, 4)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_chat_needs_a_template_and_uses_it(pair, client):
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}])
    target, draft, tok = pair
    tok = type(tok).from_pretrained(tok.name_or_path)
    tok.chat_template = CHAT_TEMPLATE
    chat = openai.OpenAI(base_url=start(Server(target, draft, tok, TREE, model_name="demo")) + "/v1", api_key="none")
    messages = [{"role": "user", "content": "fibonacci"}]
    out = chat.chat.completions.create(model="demo", messages=messages, max_tokens=16, temperature=0)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert out.choices[0].message.content == tok.decode(reference(pair, [ids], 16), skip_special_tokens=True)
    parts = list(chat.chat.completions.create(model="demo", messages=messages, max_tokens=16, temperature=0, stream=True))
    assert "".join(p.choices[0].delta.content or "" for p in parts) == out.choices[0].message.content


@pytest.mark.parametrize("kwargs,param", [
    (dict(n=2), "n"), (dict(max_tokens=-1), "max_tokens"), (dict(temperature=-1), "temperature"),
    (dict(extra_body={"frobnicate": 1}), "frobnicate"), (dict(logprobs=2), "logprobs"),
    (dict(max_tokens=5000), None),  # past the context window
])
def test_bad_requests_are_400_and_the_server_stays_up(client, url, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="demo", prompt=PROMPT, **{"max_tokens": 8, **kwargs})
    assert err.value.body["type"] == "invalid_request_error"
    if param:
        assert err.value.body["param"] == param
    assert httpx.get(url + "/health").json() == {"status": "ok"}


def test_malformed_json_is_400(url):
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_models_and_metrics(client, url):
    assert [m.id for m in client.models.list()] == ["demo"]
    client.completions.create(model="demo", prompt=PROMPT, max_tokens=16, temperature=0)
    text = httpx.get(url + "/metrics").text
    for name in ("opttree:spec_decode_num_drafts_total", "opttree:spec_decode_num_accepted_tokens_total",
                 "opttree:spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"}",
                 "opttree:spec_decode_mean_acceptance_length"):
        assert name in text
    mal = float(next(line.split()[-1] for line in text.splitlines() if line.startswith("opttree:spec_decode_mean_acc")))
    assert mal > 1.0


def test_a_full_queue_answers_429(pair):
    target, draft, tok = pair
    url = start(Server(target, draft, tok, TREE, model_name="demo", max_queue=0))
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"


def test_text_deltas_never_split_a_character_or_leak_a_stop(pair):
    tok = pair[2]
    text = "naïve → ok"
    ids = tok(text, add_special_tokens=False).input_ids
    deltas = TextStream(tok)
    pieces = [deltas.push([i]) for i in ids] + [deltas.push([], final=True)]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    deltas = TextStream(tok, stop=["→ o"])
    assert "".join([deltas.push([i]) for i in ids] + [deltas.push([], final=True)]) == "naïve "


def test_a_client_that_disconnects_cancels_its_request(pair):
    target, draft, tok = pair
    url = start(Server(target, draft, tok, TREE, model_name="demo"))
    body = {"prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body) as r:
        for _ in zip(range(3), r.iter_lines()):
            pass

    def metric(name: str) -> float:
        line = next(l for l in httpx.get(url + "/metrics").text.splitlines() if l.startswith(name))
        return float(line.split()[-1])

    for _ in range(200):
        if 'status="499"' in httpx.get(url + "/metrics").text:
            break
        time.sleep(0.05)
    assert metric('opttree:requests_total{endpoint="/v1/completions",status="499"}') == 1
    assert metric("opttree:generation_tokens_total") < 200  # stopped within a step, far from 1500
    assert metric("opttree:num_requests_waiting") == 0
    out = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0}).json()
    assert out["usage"]["completion_tokens"] == 4
