"""Structured outputs (`opttree.grammar`): the grammar's mask is a pure function of the context whatever order the
contexts come in, and answers held to a grammar are `target.generate`'s with the same processor, through every tree,
a batch, `custom_generate`, the CLI and the server."""

import json
import random

import openai
import pytest
import torch
from test_server import start

import opttree
from opttree import grammar
from opttree.cli import main
from opttree.grammar import Constraint
from opttree.server.app import Server

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "line": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                    "maxItems": 2}},
          "required": ["name", "line", "tags"], "additionalProperties": False}
PROMPT = "# the parser's settings, as JSON\nconfig = "
GRAMMARS = {
    "json schema": grammar.json_schema(SCHEMA),
    "json object": grammar.json_object(),
    "regex": grammar.regex(r"def [a-z_]{1,12}\((self)?\):"),
    "choice": grammar.choice(["True", "False", "None"]),
    "gbnf": grammar.lark('root ::= "return " [a-z]+ ("(" [0-9]+ ")")?'),
}


@pytest.fixture(scope="module")
def pair():
    return opttree.demo_models(torch.float32)


def constraint(tok, kind: str, prompt_len: int) -> Constraint:
    return Constraint(tok, GRAMMARS[kind], prompt_len)


def allowed(c: Constraint, context: list[int], vocab: int) -> torch.Tensor:
    """(V,) bool: the tokens the constraint lets follow `context`."""
    return torch.isfinite(c(torch.tensor([context]), torch.zeros(1, vocab)))[0]


def valid_paths(tok, kind: str, count: int, length: int, seed: int) -> list[list[int]]:
    """Random token paths the grammar takes (each token drawn among those allowed), and their prefixes."""
    rng, vocab = random.Random(seed), len(tok)
    paths = []
    for _ in range(count):
        c, path = constraint(tok, kind, 0), []
        for _ in range(length):
            ok = allowed(c, path, vocab).nonzero().flatten().tolist()
            ok = [t for t in ok if t != tok.eos_token_id]
            if not ok:
                break
            path.append(rng.choice(ok))
            paths.append(list(path))
    return paths


@pytest.mark.parametrize("kind", ["json schema", "regex", "gbnf"])
def test_the_mask_is_a_pure_function_of_the_context_in_any_order(pair, kind):
    """One matcher asked about contexts in a shuffled order (rolling back and forward) gives each the mask a fresh
    matcher gives; every token allowed is one the grammar takes there (brute force over the vocabulary: llguidance's
    mask may also leave out a token that only starts a word another way); the prompt's tokens are not matched; a
    context the grammar refuses keeps its scores."""
    _, _, tok = pair
    vocab = len(tok)
    paths = valid_paths(tok, kind, count=6, length=10, seed=1)
    order = paths * 2
    random.Random(2).shuffle(order)
    prompt = tok("x = ", add_special_tokens=False).input_ids
    shared = Constraint(tok, GRAMMARS[kind], len(prompt))
    for path in order:
        assert torch.equal(allowed(shared, prompt + path, vocab), allowed(constraint(tok, kind, 0), path, vocab))
    import llguidance

    for path in paths[:3]:  # brute force: every token tried after the path
        matcher = llguidance.LLMatcher(shared.tokenizer, GRAMMARS[kind], log_level=0)
        assert matcher.consume_tokens(path)
        takes = torch.tensor([matcher.validate_tokens([t]) == 1 for t in range(vocab)])
        takes[tok.eos_token_id] = matcher.is_accepting()
        mask = allowed(shared, prompt + path, vocab)
        assert mask.any() and not (mask & ~takes).any() and (mask == takes).float().mean() > 0.999
    refused = [t for t in range(vocab) if not allowed(shared, prompt, vocab)[t]][0]
    scores = torch.randn(2, vocab)
    out = shared(torch.tensor([prompt + [refused, 5], prompt + [refused, 7]]), scores)
    assert torch.equal(out, scores)
    import pickle

    again = pickle.loads(pickle.dumps(shared))  # as a sharded server's ranks receive it
    assert all(torch.equal(allowed(again, prompt + path, vocab), allowed(shared, prompt + path, vocab))
               for path in paths[:4])
    wide = shared(torch.tensor([prompt]), torch.zeros(1, vocab + 40))  # logits wider than the tokenizer
    assert torch.isinf(wide[0, vocab:]).all() and torch.equal(torch.isfinite(wide[0, :vocab]),
                                                               allowed(shared, prompt, vocab))


@pytest.mark.parametrize("kind", list(GRAMMARS))
@pytest.mark.parametrize("tree", [dict(budget=16), dict(tree="chain", budget=4), dict(drafter="recycling+lookup")],
                         ids=["opt-draft", "chain", "train-free"])
def test_greedy_answers_equal_generate_with_the_same_constraint(pair, kind, tree):
    target, draft, tok = pair
    ids = tok(PROMPT, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.inference_mode():
        ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=48,
                              logits_processor=[constraint(tok, kind, ids.shape[1])])[0, ids.shape[1]:].tolist()
    uses_draft = "drafter" not in tree
    out = opttree.generate(target, ids, draft if uses_draft else None, max_new_tokens=48, temperature=0,
                           logits_processor=[constraint(tok, kind, ids.shape[1])], **tree)
    assert out.new_tokens.tolist() == ref
    answer = tok.decode(ref, skip_special_tokens=True)
    if ref[-1] == tok.eos_token_id:  # a whole answer: a sentence of the grammar
        assert constraint(tok, kind, 0).complete(ref)
        if kind.startswith("json"):
            doc = json.loads(answer)
            assert isinstance(doc, dict) and (kind != "json schema" or set(doc) == set(SCHEMA["properties"]))
    else:
        assert constraint(tok, kind, 0)._follow(ref)  # cut by max_new_tokens: a prefix of one


def test_whole_answers_in_every_grammar(pair):
    """The shipped target completes each grammar here within 48 tokens (so the test above checks whole answers)."""
    target, _, tok = pair
    ids = tok(PROMPT, return_tensors="pt", add_special_tokens=False).input_ids
    for kind in ("json schema", "regex", "choice", "gbnf"):
        out = opttree.generate(target, ids, None, max_new_tokens=48, temperature=0,
                               logits_processor=[constraint(tok, kind, ids.shape[1])])
        assert out.new_tokens[-1] == tok.eos_token_id, kind


def test_sampled_answers_keep_to_the_grammar_and_their_seeds(pair):
    target, draft, tok = pair
    ids = tok(PROMPT, return_tensors="pt", add_special_tokens=False).input_ids
    for seed in range(4):
        run = dict(max_new_tokens=40, temperature=1.0, seed=seed, budget=8)
        out = opttree.generate(target, ids, draft, logits_processor=[constraint(tok, "json schema", ids.shape[1])],
                               **run)
        again = opttree.generate(target, ids, draft, logits_processor=[constraint(tok, "json schema", ids.shape[1])],
                                 **run)
        tokens = out.new_tokens.tolist()
        assert tokens == again.new_tokens.tolist()
        c = constraint(tok, "json schema", 0)
        assert c.complete(tokens) if tokens[-1] == tok.eos_token_id else c._follow(tokens)


@pytest.mark.parametrize("drafter", [None, "recycling+lookup"])
def test_a_batch_holds_each_row_to_its_own_grammar_or_none(pair, drafter):
    """Rows held to different grammars and rows held to none (whose drafters may draft together) in one batch:
    each row's answer is what it gives alone."""
    target, draft, tok = pair
    prompts = [tok(p, add_special_tokens=False).input_ids for p in (PROMPT, "def parse(", "x = ", PROMPT, "x = ")]
    kinds = ["json schema", "regex", "choice", None, None]
    settings = dict(budget=8) if drafter is None else dict(budget=8, drafter=drafter)
    used = draft if drafter is None else None
    speculator = opttree.Speculator(target, used, tokenizer=tok, **settings)

    def held(p, k):
        return None if k is None else [constraint(tok, k, len(p))]

    outs = speculator.generate([opttree.Request(p, max_new_tokens=32, temperature=0, logits_processor=held(p, k))
                                for p, k in zip(prompts, kinds)])
    for p, k, out in zip(prompts, kinds, outs):
        alone = opttree.generate(target, torch.tensor([p]), used, max_new_tokens=32, temperature=0,
                                 logits_processor=held(p, k), **settings)
        assert out.new_tokens.tolist() == alone.new_tokens.tolist()


def test_custom_generate_applies_the_constraint(pair):
    target, draft, tok = pair
    enc = tok(PROMPT, return_tensors="pt", add_special_tokens=False)
    n = enc.input_ids.shape[1]
    with torch.inference_mode():
        ref = target.generate(**enc, do_sample=False, max_new_tokens=40, logits_processor=[constraint(tok, "regex", n)])
        ours = target.generate(**enc, custom_generate=opttree.custom_generate, assistant_model=draft, do_sample=False,
                               max_new_tokens=40, logits_processor=[constraint(tok, "regex", n)])
    assert torch.equal(ours, ref)


def test_bad_grammars_are_clear_errors(pair):
    _, _, tok = pair
    for make, message in ((lambda: grammar.regex("(ab"), "unclosed group"),
                          (lambda: grammar.json_schema("{not json"), "not JSON"),
                          (lambda: grammar.json_schema([1]), "JSON object"),
                          (lambda: grammar.choice([]), "non-empty strings"),
                          (lambda: grammar.lark("start: missing_rule"), "unknown name"),
                          (lambda: grammar.one_of(regex="a", choice=["b"]), "one grammar at a time")):
        with pytest.raises(ValueError, match=message):
            Constraint(tok, make(), 0)
    with pytest.raises(ValueError, match="end-of-sequence"):
        Constraint(tok, GRAMMARS["regex"], 0, eos_token_id=[])


def test_generate_command_holds_the_answer_to_a_schema(pair, tmp_path, capsys):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    base = ["generate", "--prompt", PROMPT, "--dtype", "float32", "--tree", "opt", "--budget", "8", "--temperature",
            "0", "--max-new-tokens", "48", "--json"]
    assert main([*base, "--json-schema", str(schema)]) == 0
    doc = json.loads(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"].replace("<|endoftext|>", ""))
    assert set(doc) == set(SCHEMA["properties"])
    assert main([*base, "--choice", "yes", "--choice", "no"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"].startswith(("yes", "no"))
    assert main([*base, "--regex", "(ab"]) == 2
    assert "the grammar is not valid" in capsys.readouterr().err


@pytest.fixture(scope="module")
def client(pair):
    target, draft, tok = pair
    url = start(Server(target, draft, tok, dict(tree="opt", budget=8, delta=0.1), model_name="demo"))
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("fields,kind", [
    (dict(extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}),
     "json schema"),  # (OpenAI's completions have no response_format; vLLM's take it, as extra fields)
    (dict(extra_body={"response_format": {"type": "json_object"}}), "json object"),
    (dict(extra_body={"guided_json": SCHEMA}), "json schema"),
    (dict(extra_body={"guided_regex": r"def [a-z_]{1,12}\((self)?\):"}), "regex"),
    (dict(extra_body={"guided_choice": ["True", "False", "None"]}), "choice"),
    (dict(extra_body={"structured_outputs": {"choice": ["True", "False", "None"]}}), "choice"),
    (dict(extra_body={"guided_grammar": 'root ::= "return " [a-z]+ ("(" [0-9]+ ")")?'}), "gbnf"),
])
def test_the_server_holds_answers_to_the_grammar_asked(pair, client, fields, kind):
    target, draft, tok = pair
    out = client.completions.create(model="demo", prompt=PROMPT, max_tokens=48, temperature=0, **fields)
    ids = tok(PROMPT, return_tensors="pt", add_special_tokens=False).input_ids
    ref = opttree.generate(target, ids, draft, max_new_tokens=48, temperature=0, tree="opt", budget=8, delta=0.1,
                           logits_processor=[constraint(tok, kind, ids.shape[1])])
    assert out.choices[0].text == tok.decode(ref.new_tokens, skip_special_tokens=True)
    assert out.choices[0].finish_reason == "stop"


def test_chat_answers_in_json(pair, client):
    _, _, tok = pair
    tok.chat_template = "{% for m in messages %}# {{ m['content'] }}\n{% endfor %}config = "
    out = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "the settings"}],
                                         max_tokens=48, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)


@pytest.mark.parametrize("fields,message", [
    (dict(extra_body={"response_format": {"type": "json_schema"}}), "needs \"json_schema\""),
    (dict(extra_body={"response_format": {"type": "xml"}}), "one of text, json_object, json_schema"),
    (dict(extra_body={"guided_regex": "(ab"}), "unclosed group"),
    (dict(extra_body={"guided_json": "{not json"}), "not JSON"),
    (dict(extra_body={"guided_regex": "a", "guided_choice": ["b"]}), "an answer follows one grammar"),
    (dict(extra_body={"structured_outputs": {"xml": "a"}}), "this server takes"),
    (dict(extra_body={"guided_choice": ["a"], "ignore_eos": True}), "ignore_eos with a grammar"),
])
def test_bad_grammars_are_400s_and_the_server_goes_on(client, fields, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(model="demo", prompt="x = ", max_tokens=4, **fields)
    assert client.completions.create(model="demo", prompt="x = ", max_tokens=4, temperature=0).choices[0].text


def test_sampled_answers_follow_the_held_targets_distribution(pair):
    """At T=1, the first two tokens under a grammar (a regex of two letters: one two-letter token, or two one-letter
    ones) against the target's masked distribution, enumerated: the draft's masked and renormalised distribution
    (`HeldDrafter`) is the one its sampled children are drawn from and verified against."""
    from collections import Counter

    from helpers import chi_square_pvalue

    target, draft, tok = pair
    ids = tok("    return ", return_tensors="pt", add_special_tokens=False).input_ids
    held = grammar.regex("[a-d][a-d]")
    c = Constraint(tok, held, ids.shape[1])
    eos = tok.eos_token_id
    with torch.inference_mode():
        first = torch.softmax(c(ids, target(ids).logits[:, -1].float()), -1)[0]
        exact = {}
        for a in first.nonzero().flatten().tolist():
            context = torch.cat([ids, torch.tensor([[a]])], dim=1)
            second = torch.softmax(c(context, target(context).logits[:, -1].float()), -1)[0]
            exact.update({(a, b): float(first[a] * second[b]) for b in second.nonzero().flatten().tolist()})
    assert sum(1 for a, b in exact if b == eos) >= 5 and sum(1 for a, b in exact if b != eos) >= 10
    runs = 600
    speculator = opttree.Speculator(target, draft, budget=8, tokenizer=tok)
    outs = speculator.generate([opttree.Request(ids, max_new_tokens=2, temperature=1.0, seed=s,
                                                logits_processor=[Constraint(tok, held, ids.shape[1])])
                                for s in range(runs)])
    counts = Counter(tuple(out.new_tokens.tolist()) for out in outs)
    assert chi_square_pvalue(counts, exact, runs) > 1e-3


def test_the_draft_held_to_the_grammar_drafts_through_what_it_forces(pair, monkeypatch):
    """The draft masked as the target is (`HeldDrafter`) accepts far more a step on a JSON schema than the draft
    left alone, with the same tokens."""
    from opttree.step.drafters.held import HeldDrafter

    target, draft, tok = pair
    ids = tok(PROMPT, return_tensors="pt", add_special_tokens=False).input_ids

    def run():
        return opttree.generate(target, ids, draft, max_new_tokens=48, temperature=0, budget=16,
                                logits_processor=[constraint(tok, "json schema", ids.shape[1])])

    held = run()
    monkeypatch.setattr(HeldDrafter, "_held", lambda self, logq, paths: logq)
    alone = run()
    assert held.new_tokens.tolist() == alone.new_tokens.tolist()
    assert held.stats.mean_accepted_length > 1.5 * alone.stats.mean_accepted_length, (
        held.stats.mean_accepted_length, alone.stats.mean_accepted_length)
