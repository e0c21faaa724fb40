"""`opttree serve` end to end: a real uvicorn server on a local port, the official `openai` client."""

import json
import signal
from collections import Counter
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn

import opttree
from opttree.server.app import GracefulServer, Server, Turns, create_app
from opttree.server.load import CYCLE, WORDS, Outcome, _check_metrics, _check_texts, _choices_problem, run_load
from opttree.text import TextStream

TREE = dict(tree="opt", budget=4, delta=0.1)
PROMPT = "def fibonacci(n):\n"
CHAT_TEMPLATE = "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}def {% endif %}"


def start(server: Server, grace: float = 30.0) -> str:
    return start_server(server, grace)[0]


def start_server(server: Server, grace: float = 30.0) -> tuple[str, GracefulServer, threading.Thread]:
    """A real uvicorn server on a free local port, in a thread, as `opttree serve` runs it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="warning",
                            timeout_graceful_shutdown=grace + 5)
    uv = GracefulServer(config, server, grace)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    for _ in range(200):
        if uv.started:
            return f"http://127.0.0.1:{port}", uv, thread
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


def tokens(job) -> list[int]:
    """Every token a job's chunks bring (waiting for them)."""
    return [t for chunk in job.chunks() for t in chunk.ids]


def reference(pair, prompt_ids, n, **kw) -> list[int]:
    """The library's tokens for what a request asks; top_k off unless asked, as the server's default (vLLM's)."""
    target, draft, _ = pair
    kw = {"top_k": 0, **kw}
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


def test_vllms_top_k_and_min_p_fields_apply(client):
    greedy = client.completions.create(model="demo", prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    sampled = [client.completions.create(model="demo", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=5,
                                         extra_body=extra).choices[0].text
               for extra in ({}, {"top_k": 1}, {"min_p": 1.0}, {"top_k": -1, "min_p": 0.0})]
    assert sampled[1] == sampled[2] == greedy != sampled[0]  # one token left at every position: the greedy text
    assert sampled[3] == sampled[0]  # -1 and 0: off


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


def teacher_forced(target, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """(len(answer), V) the target's log-probabilities at each answer token, from one forward over prompt + answer."""
    with torch.inference_mode():
        logits = target(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1: -1]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_are_the_targets_raw_log_probabilities_at_each_token(pair, client, temperature):
    """Completions' `logprobs=k`: each token's log-probability under the target's raw logits (before temperature,
    as vLLM reports them), the k likeliest with the chosen one, the offsets of the tokens' text; the same streamed."""
    target, _, tok = pair
    prompt = tok(PROMPT, add_special_tokens=False).input_ids
    ask = dict(model="demo", prompt=PROMPT, max_tokens=24, temperature=temperature, seed=11, logprobs=3)
    out = client.completions.create(**ask).choices[0]
    lp = out.logprobs
    answer = reference(pair, [prompt], 24, temperature=temperature, seed=11)  # its tokens: the library's, seeded alike
    assert tok.decode(answer) == out.text
    assert "".join(lp.tokens) == out.text and len(lp.tokens) == len(lp.token_logprobs) == 24
    assert [len("".join(lp.tokens[:i])) for i in range(24)] == lp.text_offset
    forced = teacher_forced(target, prompt, answer)  # (24, V)
    assert torch.allclose(torch.tensor(lp.token_logprobs), forced.gather(1, torch.tensor(answer)[:, None])[:, 0],
                          atol=1e-4)
    for top, ref in zip(lp.top_logprobs, forced):
        best = ref.topk(3)
        assert {tok.decode([t]): v for t, v in zip(best.indices.tolist(), best.values.tolist())}.keys() <= top.keys()
        assert torch.allclose(torch.tensor(sorted(top.values(), reverse=True)[:3]), best.values, atol=1e-4)
    if temperature == 0:  # greedy: the chosen token is the likeliest
        assert all(max(top.values()) == v for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    parts = list(client.completions.create(**ask, stream=True))
    streamed = [p.choices[0].logprobs for p in parts if p.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
    assert sum((s.token_logprobs for s in streamed), []) == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_penalties_are_applied_as_generate_applies_them(pair, client):
    """OpenAI's presence and frequency penalties and vLLM's repetition penalty: greedy, the text
    `target.generate` gives with those processors; sampled, what the library gives with them and the seed."""
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    from opttree.genconfig import OutputPenalties

    target, _, tok = pair
    ids = tok(PROMPT, return_tensors="pt", add_special_tokens=False).input_ids
    ask = dict(model="demo", prompt=PROMPT, max_tokens=32, presence_penalty=0.4, frequency_penalty=0.8,
               extra_body={"repetition_penalty": 1.3})
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3), OutputPenalties(ids.shape[1], 0.4, 0.8)])
    with torch.inference_mode():
        hf = target.generate(ids, do_sample=False, max_new_tokens=32, attention_mask=torch.ones_like(ids),
                             logits_processor=processors)
    greedy = client.completions.create(**ask, temperature=0).choices[0].text
    assert greedy == tok.decode(hf[0, ids.shape[1]:], skip_special_tokens=True)
    assert greedy != client.completions.create(model="demo", prompt=PROMPT, max_tokens=32, temperature=0).choices[0].text
    sampled = client.completions.create(**ask, temperature=1.0, seed=9).choices[0].text
    alone = reference(pair, ids, 32, temperature=1.0, seed=9, logits_processor=processors)
    assert sampled == tok.decode(alone, skip_special_tokens=True)


def test_logit_bias_is_added_at_every_position(pair, client):
    """OpenAI's `logit_bias`: +100 on a token makes every greedy token that one; -100 on the greedy answer's second
    token changes the answer into what `target.generate` gives with that bias."""
    from transformers import SequenceBiasLogitsProcessor

    target, _, tok = pair
    ids = tok(PROMPT, return_tensors="pt", add_special_tokens=False).input_ids
    forced = client.completions.create(model="demo", prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={"42": 100})
    assert forced.choices[0].text == tok.decode([42] * 6)
    plain = reference(pair, ids, 16)
    biased = client.completions.create(model="demo", prompt=PROMPT, max_tokens=16, temperature=0,
                                       logit_bias={str(plain[1]): -100}).choices[0].text
    with torch.inference_mode():
        hf = target.generate(ids, do_sample=False, max_new_tokens=16, attention_mask=torch.ones_like(ids),
                             logits_processor=[SequenceBiasLogitsProcessor([[[plain[1]], -100.0]])])
    assert biased == tok.decode(hf[0, ids.shape[1]:], skip_special_tokens=True) != tok.decode(plain)


def test_stop_token_ids_end_an_answer_and_ignore_eos_decodes_past_eos(pair, client):
    """vLLM's `stop_token_ids` (the answer ends with the first of them, kept) and `ignore_eos`."""
    target, _, tok = pair
    ids = tok(PROMPT, add_special_tokens=False).input_ids
    plain = reference(pair, [ids], 12)
    stop = next(t for i, t in enumerate(plain) if i >= 2 and t not in plain[:i])
    out = client.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"stop_token_ids": [stop]}).choices[0]
    cut = plain[: plain.index(stop) + 1]
    assert out.text == tok.decode(cut, skip_special_tokens=True) and out.finish_reason == "stop"
    eos = target.generation_config.eos_token_id
    eos = eos if isinstance(eos, int) else eos[0]
    ask = dict(model="demo", prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={str(eos): 100})  # EOS first
    ended = client.completions.create(**ask)
    assert ended.usage.completion_tokens == 1 and ended.choices[0].finish_reason == "stop"
    past = client.completions.create(**ask, extra_body={"ignore_eos": True})
    assert past.usage.completion_tokens == 4 and past.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, extra_body={"stop_token_ids": [10**6]})
    assert err.value.body["param"] == "stop_token_ids"


def test_output_penalties_count_the_generated_tokens_only():
    from opttree.genconfig import OutputPenalties

    scores = torch.zeros(2, 6)
    context = torch.tensor([[1, 1, 2, 2, 2, 5], [3, 3, 0, 4, 4, 4]])  # 2 prompt tokens, then 4 generated
    out = OutputPenalties(2, presence=0.5, frequency=0.25)(context, scores)
    expected = torch.tensor([[0, 0, -1.25, 0, 0, -0.75], [-0.75, 0, 0, 0, -1.25, 0]])
    assert torch.equal(out, expected)


def test_n_sampled_choices_are_n_rows_each_seeded_as_a_batch_row(pair, client):
    """`n` sampled choices decode as n rows of the batch, choice i seeded with seed + i (what that seed gives alone);
    streamed, every choice's events add up to its whole text; usage counts every choice's tokens."""
    _, _, tok = pair
    ids = tok(PROMPT, add_special_tokens=False).input_ids
    ask = dict(model="demo", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=5, n=3)
    out = client.completions.create(**ask)
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    assert [c.index for c in out.choices] == [0, 1, 2] and len(set(texts)) == 3
    alone = [reference(pair, [ids], 16, temperature=1.0, seed=5 + i) for i in range(3)]
    assert texts == [tok.decode(tokens, skip_special_tokens=True) for tokens in alone]
    assert out.usage.completion_tokens == sum(map(len, alone))
    parts = list(client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    streamed = ["".join(p.choices[0].text for p in parts if p.choices and p.choices[0].index == i) for i in range(3)]
    assert streamed == texts
    finished = [p.choices[0].index for p in parts if p.choices and p.choices[0].finish_reason]
    assert sorted(finished) == [0, 1, 2] and parts[-1].usage.completion_tokens == out.usage.completion_tokens
    assert parts[-1].choices == [] and all(p.usage is None for p in parts[:-1])  # OpenAI's include_usage chunk


def test_several_prompts_in_one_request_answer_one_after_another(pair, client):
    """OpenAI's list of prompts (texts or token lists): prompt p's j-th choice is choice p * n + j, seeded with
    seed + p * n + j; echoed, each after its own prompt; streamed, by index; usage counts every prompt."""
    _, _, tok = pair
    texts = ["def fibonacci(n):\n", "import os\n"]
    ids = [tok(t, add_special_tokens=False).input_ids for t in texts]
    out = client.completions.create(model="demo", prompt=texts, max_tokens=8, temperature=1.0, seed=4, n=2)
    got = {c.index: c.text for c in out.choices}
    assert got == {2 * p + j: tok.decode(reference(pair, [ids[p]], 8, temperature=1.0, seed=4 + 2 * p + j),
                                         skip_special_tokens=True) for p in range(2) for j in range(2)}
    assert out.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    greedy = client.completions.create(model="demo", prompt=ids, max_tokens=8, temperature=0, echo=True)
    assert [c.text for c in greedy.choices] == [texts[p] + tok.decode(reference(pair, [ids[p]], 8),
                                                                       skip_special_tokens=True) for p in range(2)]
    parts = [p.choices[0] for p in client.completions.create(model="demo", prompt=texts, max_tokens=8, temperature=1.0,
                                                             seed=4, n=2, stream=True)]
    assert {i: "".join(p.text for p in parts if p.index == i) for i in range(4)} == got


def test_n_greedy_choices_are_copies_of_one_row(pair, client):
    _, _, tok = pair
    ids = tok(PROMPT, add_special_tokens=False).input_ids
    one = client.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0)
    out = client.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0, n=2, logprobs=1)
    assert [c.text for c in out.choices] == [one.choices[0].text] * 2
    assert out.choices[0].text == tok.decode(reference(pair, [ids], 12), skip_special_tokens=True)
    assert out.choices[0].logprobs.token_logprobs == out.choices[1].logprobs.token_logprobs
    assert out.usage.completion_tokens == 2 * one.usage.completion_tokens


def test_echo_scores_the_prompt_as_evaluation_harnesses_ask(pair, client):
    """`echo=True, max_tokens=0, logprobs=1` (how lm-evaluation-harness scores a text): the prompt's tokens with their
    log-probabilities under the target, the first without one; with max_tokens the answer follows the prompt, its
    offsets counting the prompt's characters; streamed, the same."""
    target, _, tok = pair
    ids = tok(PROMPT, add_special_tokens=False).input_ids
    scored = client.completions.create(model="demo", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                       temperature=0).choices[0]
    lp = scored.logprobs
    assert scored.text == PROMPT == "".join(lp.tokens) and scored.finish_reason == "length"
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
    with torch.inference_mode():
        forced = torch.log_softmax(target(torch.tensor([ids])).logits[0, :-1].float(), -1)  # (P - 1, V)
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:]), forced.gather(1, torch.tensor(ids[1:])[:, None])[:, 0],
                          atol=1e-4)
    assert [max(top.values()) for top in lp.top_logprobs[1:]] == pytest.approx(forced.max(-1).values.tolist(), abs=1e-4)
    ask = dict(model="demo", prompt=PROMPT, max_tokens=8, echo=True, logprobs=2, temperature=0)
    both = client.completions.create(**ask).choices[0]
    answer = client.completions.create(model="demo", prompt=PROMPT, max_tokens=8, logprobs=2, temperature=0).choices[0]
    assert both.text == PROMPT + answer.text
    assert both.logprobs.tokens == lp.tokens + answer.logprobs.tokens
    assert both.logprobs.text_offset == lp.text_offset + [len(PROMPT) + o for o in answer.logprobs.text_offset]
    assert both.logprobs.token_logprobs[len(ids):] == answer.logprobs.token_logprobs
    parts = [p.choices[0] for p in client.completions.create(**ask, stream=True)]
    assert "".join(p.text for p in parts) == both.text
    assert sum((p.logprobs.tokens for p in parts if p.logprobs), []) == both.logprobs.tokens
    alone = [p.choices[0] for p in client.completions.create(model="demo", prompt=PROMPT, max_tokens=0, echo=True,
                                                             logprobs=1, temperature=0, stream=True)]
    assert [(p.text, p.finish_reason, p.logprobs.tokens) for p in alone] == [(PROMPT, "length", lp.tokens)]
    plain = client.completions.create(model="demo", prompt=PROMPT, max_tokens=8, echo=True, temperature=0).choices[0]
    assert plain.text == both.text and plain.logprobs is None
    with pytest.raises(openai.BadRequestError, match="max_tokens=0 needs echo"):
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=0)


@pytest.mark.parametrize("where", ["inside a token", "at a token's start"])
def test_logprobs_stop_with_the_text_at_a_stop_string(client, where):
    """A token is reported once its text begins in the answer: at a stop string, none after the text's end."""
    ask = dict(model="demo", prompt=PROMPT, max_tokens=32, temperature=0, logprobs=0)
    whole = client.completions.create(**ask).choices[0]
    stop = whole.text[10:13]
    if where == "at a token's start":  # a token of 2+ characters whose text first appears where it begins
        lp = whole.logprobs
        stop = next(t for t, at in zip(lp.tokens[3:], lp.text_offset[3:]) if len(t) > 1 and whole.text.index(t) == at)
    out = client.completions.create(**ask, stop=stop).choices[0]
    tokens, offsets = out.logprobs.tokens, out.logprobs.text_offset
    assert out.text == whole.text[: whole.text.index(stop)]
    assert "".join(tokens).startswith(out.text) and offsets[-1] < len(out.text) <= offsets[-1] + len(tokens[-1])
    assert tokens == whole.logprobs.tokens[: len(tokens)]
    assert all(len(top) == 1 for top in out.logprobs.top_logprobs)  # logprobs=0: the chosen token's alone
    parts = client.completions.create(**ask, stop=[stop], stream=True)
    assert sum((p.choices[0].logprobs.tokens for p in parts if p.choices[0].logprobs), []) == tokens


def test_chat_answers_run_to_the_context_window_by_default_and_read_text_parts(pair):
    """Chat without max_tokens: up to the end of the context window (OpenAI's and vLLM's default; completions keep
    16); content as OpenAI's text parts, joined as vLLM joins them; other parts and a full window get a 400."""
    target, draft, tok = pair
    tok = type(tok).from_pretrained(tok.name_or_path)
    tok.chat_template = CHAT_TEMPLATE
    server = Server(target, draft, tok, TREE, model_name="demo")
    server.window = 40  # a short context window, so that the answer reaches its end
    chat = openai.OpenAI(base_url=start(server) + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "fibonacci"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    out = chat.chat.completions.create(model="demo", messages=messages, temperature=0)
    assert out.usage.completion_tokens == 40 - len(ids) and out.choices[0].finish_reason == "length"
    assert out.choices[0].message.content == tok.decode(reference(pair, [ids], 40 - len(ids)), skip_special_tokens=True)
    parts = [{"role": "user", "content": [{"type": "text", "text": "fibo"}, {"type": "text", "text": "nacci"}]}]
    joined = [{"role": "user", "content": "fibo\nnacci"}]
    assert chat.chat.completions.create(model="demo", messages=parts, temperature=0, max_tokens=8).choices[0].message \
        == chat.chat.completions.create(model="demo", messages=joined, temperature=0, max_tokens=8).choices[0].message
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    with pytest.raises(openai.BadRequestError, match="text parts"):
        chat.chat.completions.create(model="demo", messages=image)
    with pytest.raises(openai.BadRequestError, match="fills the model's context window"):
        chat.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x " * 60}])


def test_chat_logprobs_in_the_chat_format(pair):
    target, draft, tok = pair
    tok = type(tok).from_pretrained(tok.name_or_path)
    tok.chat_template = CHAT_TEMPLATE
    chat = openai.OpenAI(base_url=start(Server(target, draft, tok, TREE, model_name="demo")) + "/v1", api_key="none",
                         max_retries=0)
    ask = dict(model="demo", messages=[{"role": "user", "content": "fibonacci"}], max_tokens=12, temperature=0)
    plain = chat.chat.completions.create(**ask).choices[0]
    assert plain.logprobs is None
    out = chat.chat.completions.create(**ask, logprobs=True, top_logprobs=2).choices[0]
    assert out.message.content == plain.message.content
    content = out.logprobs.content
    assert "".join(t.token for t in content) == out.message.content
    assert all(bytes(t.bytes).decode() == t.token and len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob == t.logprob >= t.top_logprobs[1].logprob for t in content)  # greedy
    no_top = chat.chat.completions.create(**ask, logprobs=True).choices[0].logprobs.content
    assert no_top and all(t.top_logprobs == [] for t in no_top)
    parts = chat.chat.completions.create(**ask, logprobs=True, top_logprobs=2, stream=True)
    streamed = sum((p.choices[0].logprobs.content for p in parts if p.choices and p.choices[0].logprobs), [])
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    sampled = {**ask, "temperature": 1.0, "seed": 3, "n": 2}
    two = chat.chat.completions.create(**sampled, stream=True)
    events = [p.choices[0] for p in two if p.choices]
    assert sorted(e.index for e in events if e.delta.content == "") == [0, 1]  # each choice's first event
    texts = ["".join(e.delta.content or "" for e in events if e.index == i) for i in (0, 1)]
    whole = chat.chat.completions.create(**sampled)
    assert texts == [c.message.content for c in whole.choices] and texts[0] != texts[1]
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        chat.chat.completions.create(**ask, top_logprobs=2)
    with pytest.raises(openai.BadRequestError) as err:
        chat.chat.completions.create(**ask, logprobs=True, top_logprobs=21)
    assert err.value.body["param"] == "top_logprobs"


@pytest.mark.parametrize("kwargs,param", [
    (dict(n=0), "n"), (dict(n=17, temperature=1), "n"),  # past --max-queue (16)
    (dict(max_tokens=-1), "max_tokens"), (dict(temperature=-1), "temperature"),
    (dict(extra_body={"frobnicate": 1}), "frobnicate"), (dict(logprobs=21), "logprobs"),
    (dict(max_tokens=5000), None),  # past the context window
    (dict(extra_body={"min_p": 1.5}), "min_p"), (dict(extra_body={"top_k": -2}), "top_k"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"), (dict(logit_bias={"8192": 1}), "logit_bias"),
    (dict(logit_bias={"5": 101}), "logit_bias"),
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
    assert client.models.list().data[0].max_model_len == 2048  # vLLM's field: the shipped target's context window
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


def test_requests_decode_one_at_a_time_in_arrival_order():
    turns, order, gone = Turns(), [], threading.Event()
    tickets = [turns.join() for _ in range(4)]  # taken in arrival order, as the server does

    def decode(i: int, give_up=lambda: False) -> None:
        if turns.wait(tickets[i], give_up):
            order.append(i)
            time.sleep(0.02)
            turns.leave(tickets[i])

    threads = [threading.Thread(target=decode, args=(i,) if i != 2 else (i, gone.is_set)) for i in (3, 2, 1)]
    for t in threads:  # started in reverse order: the line, not the threads, decides
        t.start()
    gone.set()  # request 2's client leaves while it waits
    decode(0)
    for t in threads:
        t.join(timeout=5)
    assert order == [0, 1, 3]


def test_load_eight_clients_mixing_streams_cancellations_and_malformed_requests(pair):
    target, draft, tok = pair
    url = start(Server(target, draft, tok, TREE, model_name="demo"))
    references: dict[str, list[int]] = {}

    def expected(prompt: str, n: int) -> str:
        if prompt not in references:
            ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
            references[prompt] = reference(pair, ids, 6)  # greedy: shorter answers are its prefixes
        return tok.decode(references[prompt][:n], skip_special_tokens=True)

    # 8 clients x 10 requests here (CI time); `opttree load-test` runs 8 x 20 against a served pair (docs/USAGE.md)
    report = run_load(url, clients=8, requests=10, max_tokens=4, cancel_tokens=48, expected=expected)
    summary = report.summary()
    print(report.table())
    assert report.ok, report.problems
    kinds = [CYCLE[(c + r) % len(CYCLE)] for c in range(8) for r in range(10)]
    assert summary["requests"] == 80 and summary["by_kind"] == dict(Counter(kinds))
    assert 0 < summary["latency_p50_s"] <= summary["latency_p99_s"] and summary["tokens_per_s"] > 0
    held = [o for o in report.outcomes if o.kind == "structured"]
    assert held and all(o.text in WORDS for o in held)
    assert summary["completion_tokens"] == sum(4 + (r % 3) for c in range(8) for r in range(10)
                                               if CYCLE[(c + r) % len(CYCLE)] in ("plain", "stream", "choices")) + \
        sum(o.tokens for o in held)
    # the server's own account of the load: steps of one or more requests, which took part of the wall
    account = summary["server"]
    assert account["steps"] >= summary["completion_tokens"] / (8 * 5) and 1 <= account["rows_per_step"] <= 8
    assert 0 < account["step_s"] < summary["wall_s"] and account["prefill_s_per_request"] > 0
    assert 0 < account["accepted_per_request_step"] <= TREE["budget"]  # the pair accepts some of its trees
    assert "the server:" in report.table()


def test_the_load_checks_catch_mixed_answers_and_miscounts():
    answers = [Outcome("plain", "a", 4, text="x"), Outcome("stream", "a", 4, text="y"), Outcome("cancel", "b", 4)]
    assert any("2 different answers" in p for p in _check_texts(answers, None))
    assert any("expected 'x'" in p for p in _check_texts(answers, lambda prompt, n: "x"))
    assert _check_metrics(answers, {}, {"200": 2, "499": 1}) == []
    assert _check_metrics(answers, {}, {"200": 3}) != []
    held = [Outcome("plain", "a", 4, text="x"), Outcome("structured", "a", 4, text="True")]  # each its own answer
    assert _check_texts(held, lambda prompt, n: "x") == []
    held.append(Outcome("structured", "a", 4, text="None"))
    assert any("2 different answers" in p for p in _check_texts(held, None))
    choice = {"index": 0, "text": "ab", "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.1, -0.2],
                                                      "top_logprobs": [{"a": -0.1}, {"b": -0.2}]}}
    assert _choices_problem([choice, {**choice, "index": 1}]) == ""
    assert "differ" in _choices_problem([choice, {**choice, "index": 1, "text": "ac"}])
    assert "not the text" in _choices_problem([choice, {**choice, "index": 1, "logprobs": {"tokens": ["a"]}}])
    swapped = {**choice, "index": 1, "logprobs": {**choice["logprobs"], "top_logprobs": [{"a": -0.1}, {"c": -0.1}]}}
    assert "not the likeliest" in _choices_problem([choice, swapped])


def _stream_events(url: str, body: dict, first: threading.Event, events: list) -> None:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                first.set()


def test_shutdown_lets_requests_in_flight_finish(pair):
    target, draft, tok = pair
    url, uv, thread = start_server(Server(target, draft, tok, TREE, model_name="demo"), grace=30)
    first, events = threading.Event(), []
    client = threading.Thread(target=_stream_events, args=(url, {"prompt": PROMPT, "max_tokens": 24, "temperature": 0},
                                                           first, events))
    client.start()
    assert first.wait(30)
    uv.handle_exit(signal.SIGTERM, None)  # what Ctrl-C / SIGTERM does
    client.join(30)
    thread.join(30)
    assert not thread.is_alive(), "the server did not stop"
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == tok.decode(reference(pair, tok(PROMPT, return_tensors="pt").input_ids, 24), skip_special_tokens=True)


def test_shutdown_ends_what_outlasts_the_grace_with_an_error(pair):
    target, draft, tok = pair
    url, uv, thread = start_server(Server(target, draft, tok, TREE, model_name="demo"), grace=0.5)
    first, events, queued = threading.Event(), [], {}
    long = {"prompt": PROMPT, "max_tokens": 1500, "temperature": 0}
    client = threading.Thread(target=_stream_events, args=(url, long, first, events))
    client.start()
    assert first.wait(30)
    waiter = threading.Thread(target=lambda: queued.update(r=httpx.post(url + "/v1/completions", json=long, timeout=60)))
    waiter.start()  # waits its turn behind the stream
    time.sleep(0.3)
    began = time.perf_counter()
    uv.handle_exit(signal.SIGTERM, None)
    for t in (client, waiter, thread):
        t.join(30)
    assert not thread.is_alive(), "the server did not stop"
    assert time.perf_counter() - began < 10
    assert "shut down" in json.loads(events[-1])["error"]["message"]
    assert queued["r"].status_code == 503 and "shut down" in queued["r"].json()["error"]["message"]


def test_sampled_requests_get_the_settings_chosen_for_sampling(pair):
    """`opttree serve` measures greedy and sampled settings apart (the calibration profile's two choices):
    a sampled request runs the sampled ones, a greedy request the greedy ones; the draft model goes to a
    request whose draft sources use it."""
    from opttree.server.app import CompletionRequest

    target, draft, tok = pair
    server = Server(target, draft, tok, TREE, model_name="demo",
                    sampled_options=dict(tree="dyspec", budget=3, delta=0.3, drafter="model"))
    [(_, (greedy,))] = server.start(CompletionRequest(prompt=PROMPT, temperature=0, max_tokens=4))
    [(_, (sampled,))] = server.start(CompletionRequest(prompt=PROMPT, temperature=0.8, max_tokens=4))
    assert (greedy.row.config.tree, greedy.row.config.budget) == ("opt", 4)
    assert (sampled.row.config.tree, sampled.row.config.budget, sampled.row.config.children) == ("dyspec", 3, "auto")
    plain = Server(target, draft, tok, TREE, model_name="demo", sampled_options=dict(tree="ar"))
    [(_, (job,))] = plain.start(CompletionRequest(prompt=PROMPT, temperature=1.0, max_tokens=4))
    assert job.row.config.tree == "ar" and job.row.drafter is None
    assert len(list(job.chunks())) >= 1 and job.complete


def test_every_setting_at_its_extremes_gets_a_400_naming_the_limit_or_a_right_answer(pair):
    """No request can take the server down: past a limit, a 400 that names it (before any work); at the
    limit, a correct answer; and the server keeps serving the others."""
    from opttree.server.app import Limits

    target, draft, tok = pair
    url = start(Server(target, draft, tok, TREE, model_name="demo", limits=Limits(max_budget=16, max_depth=12)))
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    refused = {
        "--max-budget": {"budget": 1_000_000}, "--max-tree-depth": {"max_depth": 100_000},
        "context window of 2048": {"max_tokens": 10**9},
        "at most 256 characters": {"stop": ["x" * 100_000]},
        "tokens exceeds the target": {"prompt": "def f():\n" * 3000},
        "seed": {"seed": 2**63}, "budget must be an integer >= 1": {"budget": 0},
        "16 rows (--max-queue)": {"n": 17, "temperature": 1}, "rows (--max-queue)": {"prompt": [PROMPT] * 17},
        "less than or equal to 20": {"logprobs": 21}, "biases -100 to 100": {"logit_bias": {"5": 1e9}},
    }
    for message, extra in refused.items():
        began = time.perf_counter()
        answer = httpx.post(url + "/v1/completions", json={**body, **extra}, timeout=60)
        assert answer.status_code == 400 and message in answer.json()["error"]["message"], (extra, answer.text)
        assert time.perf_counter() - began < 5  # refused before any work
    ids = tok(PROMPT, return_tensors="pt", add_special_tokens=False).input_ids
    expected = tok.decode(reference(pair, ids, 8), skip_special_tokens=True)
    for extra in ({"budget": 16, "max_depth": 12}, {"seed": 2**63 - 1}, {"seed": 0}, {"stop": ["x" * 256]},
                  {"n": 16}, {"prompt": [PROMPT] * 16}, {"logprobs": 20}, {"logit_bias": {"5": -100}}):
        answer = httpx.post(url + "/v1/completions", json={**body, **extra}, timeout=60)
        texts = [choice["text"] for choice in answer.json()["choices"]] if answer.status_code == 200 else answer.text
        assert texts == [expected] * extra.get("n", len(extra.get("prompt", [0]))), extra  # (token 5 is not in it)


def test_default_limits_follow_the_device_and_never_refuse_the_servers_own_settings():
    from opttree.server.app import Limits

    assert Limits.for_device("cpu") == Limits(64, 64)
    assert Limits.for_device("cuda") == Limits(256, 64)
    assert Limits.for_device("cpu", budget=100, max_depth=80) == Limits(100, 80)


def test_metrics_count_queue_time_and_what_is_running(pair):
    target, draft, tok = pair
    url = start(Server(target, draft, tok, TREE, model_name="demo"))

    def metric(name: str) -> float:
        return float(next(l for l in httpx.get(url + "/metrics").text.splitlines() if l.startswith(name + " ")).split()[-1])

    assert metric("opttree:num_requests_running") == 0
    began = time.perf_counter()
    long = threading.Thread(target=lambda: httpx.post(url + "/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": 200, "temperature": 0}))
    long.start()
    for _ in range(500):
        if metric("opttree:num_requests_running") == 1:
            break
        time.sleep(0.01)
    assert metric("opttree:num_requests_running") == 1  # the long request decodes ...
    assert metric("opttree:num_batches_running") == 1
    waited = time.perf_counter()
    httpx.post(url + "/v1/completions", timeout=120, json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    waited = time.perf_counter() - waited
    long.join()
    assert metric("opttree:num_requests_running") == 0 and metric("opttree:num_batches_running") == 0
    assert metric("opttree:request_queue_time_seconds_count") == 2
    assert 0 < metric("opttree:request_queue_time_seconds_sum") < waited  # ... while the short one waited its turn
    # where the scheduler's time went: each request's prefill, and every step of the batch timed once
    assert metric("opttree:request_prefill_time_seconds_count") == 2
    assert metric("opttree:request_prefill_time_seconds_sum") > 0
    steps = metric("opttree:batch_size_count")
    assert steps >= 200 / (TREE["budget"] + 1) and metric("opttree:iteration_seconds_count") == steps  # 200 tokens
    assert 0 < metric("opttree:iteration_seconds_sum") < time.perf_counter() - began


CODE_PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n",
                "import os\n\ndef list_files(path):\n",
                "def is_prime(n):\n", "def merge_sort(items):\n", "def read_json(path):\n"]


def _batching_server(pair, max_batch: int, batch_budget=None) -> tuple[Server, list[int]]:
    """A Server whose batcher records the rows of every step."""
    target, draft, tok = pair
    server = Server(target, draft, tok, TREE, model_name="demo", max_batch=max_batch, batch_budget=batch_budget)
    rows: list[tuple[int, int]] = []  # per step: (rows, draft nodes of all rows)
    observe = server.batcher.on_step
    server.batcher.on_step = lambda n, tokens, drafted, s: (rows.append((n, sum(drafted))),
                                                             observe(n, tokens, drafted, s))
    return server, rows


@pytest.mark.parametrize("batch_budget", ["off", "fixed", "curve", "sized"])
def test_concurrent_requests_decode_as_one_batch_each_exactly_its_own(pair, batch_budget):
    """Continuous batching: requests arriving together share each step's target forward (up to
    --max-batch rows), join and leave between steps, and each gets exactly what it gets alone: greedy
    ones their greedy output, sampled ones the draws of their seed; with one node budget for the batch
    (batch-level OPT-Tree: fixed, or chosen under a latency curve), or trees sized for the rows, too."""
    from opttree.batch_sizing import WIDTHS, BatchLatency, SizedBudget
    from opttree.server.app import CompletionRequest
    from opttree.step.policies.batch import BatchBudget

    target, draft, tok = pair
    steep = BatchLatency({1: [1.0] * len(WIDTHS), 4: [float(4 * w) for w in WIDTHS]})  # 4 rows: 1 node each
    allocator = {"off": None, "fixed": BatchBudget(fixed=3),
                 "curve": BatchBudget(curve=[0.01 + 0.002 * k for k in range(40)]), "sized": SizedBudget(steep)}
    server, rows = _batching_server(pair, max_batch=4, batch_budget=allocator[batch_budget])
    sampled = lambda i: i % 2 and batch_budget != "fixed"  # noqa: E731  (sampled trees keep their budget)
    asks = [dict(prompt=p, max_tokens=6 + 5 * i, temperature=0.8 if sampled(i) else 0.0, seed=i)
            for i, p in enumerate(CODE_PROMPTS)]
    with server.batcher.changed:  # all in line before the scheduler looks (a reentrant lock)
        jobs = [server.start(CompletionRequest(**ask))[0][1][0] for ask in asks]
    answers = [tokens(job) for job in jobs]
    for ask, job, answer in zip(asks, jobs, answers):
        ids = tok(ask["prompt"], return_tensors="pt", add_special_tokens=False).input_ids
        sampling = dict(temperature=ask["temperature"], seed=ask["seed"]) if ask["temperature"] else {}
        assert answer == reference(pair, ids, ask["max_tokens"], **sampling), ask
        assert job.complete and job.stats.new_tokens == len(answer)
        assert len(answer) == ask["max_tokens"] or answer[-1] == tok.eos_token_id  # a draw may end the text
    assert max(n for n, _ in rows) == 4  # the batch filled up to --max-batch, never past it
    if batch_budget == "fixed":
        assert max(nodes for _, nodes in rows) == 3  # one budget for the batch, whatever each request's
    if batch_budget == "sized":  # while 4 decode, each greedy tree is cut to 1 node
        assert steep.sized_budget(4, TREE["budget"]) == 1
        # each request drafts its own budget; a greedy one's tree is cut each step for the rows decoding then,
        # a sampled one's is not (the draws of its seed must not depend on the batch)
        assert [job.row.config.budget for job in jobs] == [TREE["budget"]] * len(jobs)
        assert [job.row.sized for job in jobs] == [not sampled(i) for i in range(len(jobs))]
    text = create_app(server) and __import__("prometheus_client").generate_latest(server.metrics.registry).decode()
    assert "opttree:batch_size_bucket" in text and "opttree:iteration_tokens_total_count" in text


def test_prompts_of_very_different_lengths_prefill_and_decode_apart():
    """`prefill_groups`: every prompt once, by length, each group within the padding limit (or alone); the server's
    `job_groups` the same over its jobs; `fits`: rows share a lane while their padded positions stay small or
    within the padding bound. Against brute force."""
    import itertools
    from types import SimpleNamespace

    from opttree.batch_sizing import LANE_PADDING, LANE_POSITIONS, fits
    from opttree.engine import PADDING_LIMIT, prefill_groups
    from opttree.server.batcher import job_groups

    for lengths in itertools.product([3, 20, 22, 25, 90, 1600], repeat=4):
        groups = prefill_groups(list(lengths))
        assert sorted(i for g in groups for i in g) == [0, 1, 2, 3]
        assert [lengths[i] for g in groups for i in g] == sorted(lengths)
        for g in groups:
            sizes = [lengths[i] for i in g]
            assert len(g) == 1 or max(sizes) * len(sizes) <= PADDING_LIMIT * sum(sizes)
    jobs = [SimpleNamespace(row=SimpleNamespace(prompt_len=n)) for n in (1600, 20, 25, 22)]
    assert [[j.row.prompt_len for j in g] for g in job_groups(jobs)] == [[20, 22, 25], [1600]]
    assert fits([200] * 8) and not fits([200] * 7 + [1700])  # 1,700 x 8 = 13,600 > 2 x 3,100
    assert fits([LANE_POSITIONS // 4] * 4) and fits([3000, 2500]) and not fits([100, 100, 100, 3000])
    assert not fits([LANE_POSITIONS, 10, 10]) and fits([LANE_POSITIONS] * 2)
    assert all(fits([n]) for n in (1, LANE_POSITIONS, int(LANE_PADDING * 10 ** 5)))


def test_a_long_prompt_decodes_in_a_lane_of_its_own_and_every_answer_is_exact(pair, monkeypatch):
    """A prompt far longer than the others gets a batch (lane) of its own, stepped in turn with theirs, instead of
    every short row attending over its length; each answer is still exactly its greedy output."""
    import opttree.batch_sizing as batch_sizing
    from opttree.server.app import CompletionRequest

    monkeypatch.setattr(batch_sizing, "LANE_POSITIONS", 64)  # small positions here: a 200-token prompt is "long"
    target, draft, tok = pair
    server, rows = _batching_server(pair, max_batch=4)
    long_prompt = "".join(CODE_PROMPTS) * 4
    prompts = [CODE_PROMPTS[0], long_prompt, CODE_PROMPTS[3], CODE_PROMPTS[4]]
    lanes = []
    observe = server.batcher.on_step
    server.batcher.on_step = lambda *a: (lanes.append(server.batches()), observe(*a))
    with server.batcher.changed:
        jobs = [server.start(CompletionRequest(prompt=p, max_tokens=12, temperature=0))[0][1][0] for p in prompts]
    answers = [tokens(job) for job in jobs]
    for prompt, answer in zip(prompts, answers):
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        assert answer == reference(pair, ids, 12)
    assert max(lanes) == 2 and max(n for n, _ in rows) == 3  # the three short ones together, the long one apart
    assert server.running() == 0


def test_a_request_that_cannot_share_a_batch_waits_for_the_running_lanes(pair, monkeypatch):
    """A request refused as a batch's row (`engine.check_batchable`: e.g. the early-exit source) neither joins a
    running lane nor starts one beside it: it waits until they have drained, then decodes, exactly."""
    import opttree.batch_sizing as batch_sizing
    import opttree.engine as engine
    import opttree.server.batcher as batcher
    from opttree.server.app import CompletionRequest

    monkeypatch.setattr(batch_sizing, "LANE_POSITIONS", 64)  # the long prompt would get a lane of its own
    target, draft, tok = pair
    server, _ = _batching_server(pair, max_batch=4)
    long_prompt = "".join(CODE_PROMPTS) * 4
    with server.batcher.changed:  # two short ones run together (the long one would not fit their lane)
        first, second = (server.start(CompletionRequest(prompt=p, max_tokens=40, temperature=0))[0][1][0]
                         for p in CODE_PROMPTS[:2])
    next(first.chunks())  # they run
    original, held = engine.check_batchable, {}  # held["job"]: the refused request, once started

    def refuse_alone(generation, rows):
        if "job" in held and held["job"].row in rows and len(rows) > 1:
            raise NotImplementedError("a batch of 2 prompts does not combine with this request")
        original(generation, rows)

    monkeypatch.setattr(engine, "check_batchable", refuse_alone)
    monkeypatch.setattr(batcher, "check_batchable", refuse_alone)
    joined_after = []  # whether the first two had finished when the refused one joined
    join = batcher.Lane.join
    monkeypatch.setattr(batcher.Lane, "join", lambda lane, jobs, *a: (
        joined_after.append(first.complete and second.complete) if held.get("job") in jobs else None,
        join(lane, jobs, *a))[1])
    with server.batcher.changed:  # the batcher takes it only once it is known here (and the patches are in place)
        alone = held["job"] = server.start(CompletionRequest(prompt=long_prompt, max_tokens=8, temperature=0))[0][1][0]
    answer = tokens(alone)
    assert joined_after == [True] and first.complete and second.complete
    ids = tok(long_prompt, return_tensors="pt", add_special_tokens=False).input_ids
    assert answer == reference(pair, ids, 8)


def test_a_cancelled_or_failing_request_leaves_the_batch_and_the_others_go_on(pair):
    """A request cancelled mid-way leaves the batch at the next step; one whose prefill fails ends with
    that error; the rows beside them finish exactly as alone, and the server goes on serving."""
    from opttree.server.app import CompletionRequest

    target, draft, tok = pair
    server, rows = _batching_server(pair, max_batch=8)
    long = server.start(CompletionRequest(prompt=CODE_PROMPTS[0], max_tokens=400, temperature=0))[0][1][0]
    next(long.chunks())  # it runs
    broken = server.start(CompletionRequest(prompt=CODE_PROMPTS[1], max_tokens=8, temperature=0))[0][1][0]
    broken.row.drafter.start = lambda *a: (_ for _ in ()).throw(RuntimeError("prefill failed"))  # its prefill's first act
    fine = server.start(CompletionRequest(prompt=CODE_PROMPTS[2], max_tokens=24, temperature=0))[0][1][0]
    long.close()
    with pytest.raises(RuntimeError, match="prefill failed"):
        list(broken.chunks())
    answer = tokens(fine)
    ids = tok(CODE_PROMPTS[2], return_tensors="pt", add_special_tokens=False).input_ids
    assert answer == reference(pair, ids, 24) and fine.complete
    assert not long.complete and long.stats.new_tokens < 400 and not broken.complete
    again = server.start(CompletionRequest(prompt=CODE_PROMPTS[3], max_tokens=5, temperature=0))[0][1][0]
    assert len(tokens(again)) == 5 and server.running() == 0


def test_the_scheduler_survives_an_error_of_its_own(pair):
    """An error outside any one request (here the step's observer) fails the batch's requests with it;
    the scheduler goes on and the next requests are served."""
    from opttree.server.app import CompletionRequest

    server, _ = _batching_server(pair, max_batch=4)
    calls = []

    def observer_that_fails_once(*_):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the observer broke")

    server.batcher.on_step = observer_that_fails_once
    with server.batcher.changed:
        first = [server.start(CompletionRequest(prompt=p, max_tokens=6, temperature=0))[0][1][0] for p in CODE_PROMPTS[:2]]
    for job in first:
        with pytest.raises(RuntimeError, match="observer broke"):
            list(job.chunks())
    later = server.start(CompletionRequest(prompt=CODE_PROMPTS[2], max_tokens=6, temperature=0))[0][1][0]
    assert len(tokens(later)) == 6 and later.complete


def test_serve_sizes_the_batchs_trees_unless_a_budget_is_given(pair, monkeypatch):
    """--batch-budget: sized by default (each tree cut for the rows decoding), off with --budget, a number
    of nodes, or auto; a target decoded one request at a time (chains) or one row at most shares nothing."""
    import argparse

    from opttree import batch_sizing
    from opttree import server as serve_command

    target, draft, _ = pair
    table = batch_sizing.BatchLatency({rows: [float(rows * w) for w in batch_sizing.WIDTHS] for rows in (1, 2, 4, 8)})
    monkeypatch.setattr(batch_sizing, "batch_latency", lambda model, rows: table if rows <= 8 else None)
    sized = serve_command.batch_budget(None, target, draft, max_batch=8, budget_given=False)
    assert isinstance(sized, batch_sizing.SizedBudget) and sized.latency is table
    assert serve_command.batch_budget(None, target, draft, max_batch=8, budget_given=True) is None
    assert serve_command.batch_budget("sized", target, draft, max_batch=1, budget_given=False) is None
    assert serve_command.batch_budget("5", target, draft, max_batch=8, budget_given=False).fixed == 5
    assert isinstance(serve_command.batch_budget("sized", target, draft, 8, True), batch_sizing.SizedBudget)
    monkeypatch.setattr("opttree.step.chains.verified_as_chains", lambda model: True)
    assert serve_command.batch_budget("sized", target, draft, max_batch=8, budget_given=False) is None
    assert serve_command.batch_budget_arg("sized") == "sized"
    with pytest.raises(argparse.ArgumentTypeError, match="sized, auto, off"):
        serve_command.batch_budget_arg("widest")


def test_only_the_scheduler_keeps_openmp_workers_while_it_decodes(pair, monkeypatch):
    """The setup's thread, the thread that checks a request, and the scheduler once idle each let their
    OpenMP workers go (`opttree.threads.release_openmp_threads`): with GNU OpenMP a second team of
    workers makes the decoding thread's sleep between ops (measured 1.5-1.9x slower serving)."""
    from opttree.server import app, batcher

    released = []
    spy = lambda: released.append(threading.current_thread().name) or True  # noqa: E731
    monkeypatch.setattr(app, "release_openmp_threads", spy)
    monkeypatch.setattr(batcher, "release_openmp_threads", spy)
    target, draft, tok = pair
    server = Server(target, draft, tok, TREE, model_name="demo")
    assert threading.current_thread().name in released  # the setup's thread, once the server is built
    url = start(server)
    released.clear()
    answer = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0},
                        timeout=60).json()
    assert answer["usage"]["completion_tokens"] == 6
    for _ in range(200):  # the scheduler goes idle after the answer is sent
        if "opttree-batch" in released:
            break
        time.sleep(0.01)
    assert "opttree-batch" in released  # idle: its workers went
    assert len([name for name in released if name != "opttree-batch"]) == 1  # the request's check, in its thread


def test_only_a_sampled_request_without_a_seed_may_decode_plainly_in_a_sized_batch(pair, monkeypatch):
    """The server builds each request's row with `reproducible=False` only when it is sampled and names no seed:
    a sized batch may then let it decode plainly; a seeded one keeps its seed's draws whatever the load."""
    from opttree.batch_sizing import WIDTHS, BatchLatency, SizedBudget
    from opttree.server.app import CompletionRequest
    from opttree.speculator import Speculator

    built = []
    row = Speculator.row
    monkeypatch.setattr(Speculator, "row", lambda self, request, reproducible=True: (
        built.append((request.temperature, reproducible)), row(self, request, reproducible))[1])
    target, draft, tok = pair
    sizing = SizedBudget(BatchLatency({1: [1.0] * len(WIDTHS), 2: [2.0] * len(WIDTHS)}))
    server = Server(target, draft, tok, TREE, model_name="demo", max_batch=2, batch_budget=sizing)
    jobs = [server.start(CompletionRequest(prompt=PROMPT, max_tokens=3, **ask))[0][1][0]
            for ask in ({"temperature": 1.0}, {"temperature": 1.0, "seed": 7}, {"temperature": 0})]
    for job in jobs:
        assert 1 <= len(tokens(job)) <= 3  # (a sampled text may end early: its EOS)
    assert built == [(1.0, False), (1.0, True), (0.0, False)]  # greedy: no draws, the same text either way
    assert [job.row.sized for job in jobs] == [True, False, True]  # greedy rows are sized as before


def test_a_whole_answer_takes_every_chunk_once_its_row_ends():
    """`BatchJob.result`: the answering thread sleeps until the row ends, then gets every chunk in order; an
    error the scheduler hands the job is raised there."""
    from opttree.server.batcher import BatchJob

    job = BatchJob(row=None, expired=threading.Event(), batcher=None)
    got = []
    reader = threading.Thread(target=lambda: got.append(job.result()), daemon=True)
    reader.start()
    for chunk in ([1, 2], [3], [4, 5, 6]):
        job.put(torch.tensor(chunk))
    time.sleep(0.05)
    assert not got  # still waiting: the row has not ended
    job.end(complete=True)
    reader.join(5)
    assert [[chunk.ids for chunk in chunks] for chunks in got] == [[[1, 2], [3], [4, 5, 6]]] and job.complete
    assert all(chunk.logprobs is None for chunk in got[0])  # none asked
    failed = BatchJob(row=None, expired=threading.Event(), batcher=None)
    failed.put(torch.tensor([7]))
    failed.end(error=RuntimeError("the step failed"))
    with pytest.raises(RuntimeError, match="the step failed"):
        failed.result()
