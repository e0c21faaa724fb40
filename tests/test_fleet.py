"""Scale-out: identical `opttree serve` replicas behind an ordinary round-robin HTTP proxy (written here,
as a load balancer stands for it), used by the `openai` client. Requests are stateless, so any replica
answers any request with the same greedy text; `/health` tells the balancer a replica is ready, and each
replica's `/metrics` counts its own share."""

import itertools
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest
import torch

import opttree
from opttree.server.app import Server
from test_server import PROMPT, TREE, start_server


class RoundRobin(BaseHTTPRequestHandler):
    """Forwards each request to the next replica in turn, streaming the answer back as it comes."""

    replicas: itertools.cycle
    lock = threading.Lock()

    def forward(self) -> None:
        with self.lock:
            replica = next(self.replicas)
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "accept")}
        with httpx.stream(self.command, replica + self.path, content=body, headers=headers, timeout=120) as answer:
            self.send_response(answer.status_code)
            self.send_header("content-type", answer.headers.get("content-type", "application/json"))
            self.end_headers()  # HTTP/1.0: the body ends when the connection closes
            for piece in answer.iter_raw():
                self.wfile.write(piece)
                self.wfile.flush()

    do_GET = do_POST = forward

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def fleet():
    target, draft, tok = opttree.demo_models(torch.float32)
    replicas = [start_server(Server(target, draft, tok, TREE, model_name="demo"))[0] for _ in range(2)]
    handler = type("Proxy", (RoundRobin,), {"replicas": itertools.cycle(replicas)})
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{proxy.server_address[1]}", replicas, (target, tok)
    proxy.shutdown()


def completed_requests(replica: str) -> float:
    metrics = httpx.get(replica + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith('opttree:requests_total{endpoint="/v1/completions",status="200"}'))


def test_replicas_behind_a_round_robin_proxy_answer_alike(fleet):
    url, replicas, (target, tok) = fleet
    assert all(httpx.get(r + "/health").json() == {"status": "ok"} for r in replicas)  # readiness
    ids = tok(PROMPT, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.inference_mode():
        hf = target.generate(ids, do_sample=False, max_new_tokens=16, attention_mask=torch.ones_like(ids))
    expected = tok.decode(hf[0, ids.shape[1]:], skip_special_tokens=True)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    before = [completed_requests(r) for r in replicas]
    for _ in range(2):  # each replica answers one plain and one streamed request
        out = client.completions.create(model="demo", prompt=PROMPT, max_tokens=16, temperature=0)
        assert out.choices[0].text == expected
        streamed = client.completions.create(model="demo", prompt=PROMPT, max_tokens=16, temperature=0, stream=True)
        assert "".join(event.choices[0].text for event in streamed) == expected
    assert [completed_requests(r) - b for r, b in zip(replicas, before)] == [2.0, 2.0]
    seeded = {client.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=1, seed=9)
              .choices[0].text for _ in range(2)}
    assert len(seeded) == 1  # a seed gives the same text whichever replica answers


def test_health_turns_503_when_a_replica_begins_to_shut_down():
    from fastapi.testclient import TestClient

    from opttree.server.app import create_app

    target, draft, tok = opttree.demo_models(torch.float32)
    server = Server(target, draft, tok, TREE, model_name="demo")
    client = TestClient(create_app(server))
    assert client.get("/health").status_code == 200
    server.begin_shutdown(grace=30)  # what SIGTERM does: requests in flight may still finish
    answer = client.get("/health")
    assert answer.status_code == 503 and "shutting down" in answer.json()["error"]["message"]
