"""Tiny randomly initialised models and a scripted drafter, shared by the tests."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
)

from opttree.settings.declared import Declared

CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "gpt_neox": GPTNeoXConfig, "phi3": Phi3Config}


def tiny_model(arch: str = "llama", vocab: int = 96, hidden: int = 64, layers: int = 2, seed: int = 0,
               init: float = 0.2, attn: str = "sdpa", max_positions: int = 512, **extra):
    """A small random causal LM in fp32 and eval mode. A large `init` makes its predictions peaky,
    so fp32 rounding never decides an argmax."""
    torch.manual_seed(seed)
    heads = max(hidden // 16, 2)
    config = CONFIGS[arch](
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=max_positions,
        initializer_range=init,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **({"num_key_value_heads": heads // 2} if arch != "gpt_neox" else {}),
        **extra,
    )
    config._attn_implementation = attn
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


def hf_greedy(model, prompt: torch.Tensor, max_new_tokens: int, eos_token_id=None, **kwargs) -> torch.Tensor:
    """transformers' own greedy decoding: the reference output (1, prompt + new)."""
    with torch.inference_mode():
        return model.generate(
            prompt, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
            pad_token_id=0, attention_mask=torch.ones_like(prompt), **kwargs,
        )


class ScriptedDrafter(Declared):
    """A drafter whose distribution at a node is a fixed random function of the node's path.

    Lets tests enumerate the full candidate tree and compare with brute force."""

    def __init__(self, vocab: int, seed: int = 0, sharpness: float = 2.0):
        self.vocab, self.seed, self.sharpness = vocab, seed, sharpness
        self.paths: list[tuple[int, ...]] = []
        self.expand_calls: list[int] = []

    def logq(self, path: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((self.seed,) + path) % (2**31))
        return torch.log_softmax(self.sharpness * torch.randn(self.vocab, generator=g), dim=-1)

    def start(self, input_ids):
        pass

    def root(self, committed):
        self.paths = []
        return self.logq(())

    def expand(self, tokens, parent_slots):
        self.expand_calls.append(tokens.shape[0])
        rows = []
        for token, parent in zip(tokens.tolist(), parent_slots.tolist()):
            path = (self.paths[parent] if parent >= 0 else ()) + (token,)
            self.paths.append(path)
            rows.append(self.logq(path))
        return torch.stack(rows)

    def observe(self, result):
        pass


def exact_joint(target, prompt: torch.Tensor, steps: int, temperature: float = 1.0, top_k: int = 0,
                top_p: float = 1.0, processors=(), **warpers) -> dict[tuple[int, ...], float]:
    """Enumerate the target's exact distribution of its first `steps` sampled tokens, with
    transformers' own `processors`, then the warpers `generate(do_sample=True, ...)` builds for temperature,
    top-k, top-p and `warpers` (min_p=..., typical_p=...): an independent reference for opttree's warping."""
    from transformers import GenerationConfig
    from transformers.generation.logits_process import LogitsProcessorList

    config = GenerationConfig(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, **warpers)
    warpers = LogitsProcessorList(processors)
    warpers.extend(target._get_logits_processor(config, logits_processor=LogitsProcessorList(), device="cpu"))
    joint = {(): 1.0}
    for _ in range(steps):
        grown = {}
        for seq, p in joint.items():
            ids = torch.cat([prompt[0], torch.tensor(seq, dtype=torch.long)])[None]
            with torch.inference_mode():
                logits = target(input_ids=ids).logits[:, -1].float()
            probs = warpers(ids, logits).softmax(-1)[0]
            for token, q in enumerate(probs.tolist()):
                if q > 0:
                    grown[seq + (token,)] = p * q
        joint = grown
    return joint


def chi_square_pvalue(counts: dict, expected_probs: dict, runs: int) -> float:
    """Pearson chi-square p-value, cells with expected count < 5 merged into one."""
    from scipy.stats import chisquare

    observed, expected, rest_o, rest_e = [], [], 0, 0.0
    assert set(counts) <= set(expected_probs), f"impossible outcomes sampled: {set(counts) - set(expected_probs)}"
    for cell, p in expected_probs.items():
        if p * runs >= 5:
            observed.append(counts.get(cell, 0))
            expected.append(p * runs)
        else:
            rest_o += counts.get(cell, 0)
            rest_e += p * runs
    if rest_e > 0:
        observed.append(rest_o)
        expected.append(rest_e)
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def char_tokenizer(vocab: int = 96):
    """A tokenizer with one printable character per token (ids 0..vocab-1) and no separators."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = [chr(c) for c in range(33, 33 + vocab)]
    tok = Tokenizer(models.WordLevel({ch: i for i, ch in enumerate(alphabet)}, unk_token=alphabet[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # "abc" is 3 tokens, not unknown
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=alphabet[2], pad_token=alphabet[0])


def sample_counts(target, draft, prompt, steps: int, runs: int, **kw):
    """Counter of the first `steps` generated tokens over `runs` seeded generations (seeds 0..runs-1), one
    speculator for them all (its settings and checks resolved once)."""
    from collections import Counter

    import opttree

    speculator = opttree.Speculator(target, draft, max_new_tokens=steps, eos_token_id=[], **kw)
    counts = Counter()
    for seed in range(runs):
        counts[tuple(speculator.generate(opttree.Request(prompt, seed=seed)).new_tokens.tolist())] += 1
    return counts


def path_of(tree, i: int) -> tuple[int, ...]:
    """The tokens on the root->node path of tree node i."""
    path = []
    while i >= 0:
        path.append(int(tree.tokens[i]))
        i = int(tree.parents[i])
    return tuple(path[::-1])


class Oracle(ScriptedDrafter):
    """Knows the reference output: on the reference's path it favours the next reference token (its other
    candidates random), so trees are accepted deep and also hold branches that are rejected."""

    def __init__(self, reference: torch.Tensor, vocab: int):
        super().__init__(vocab, seed=5, sharpness=1.0)
        self.reference = reference[0].tolist()

    def root(self, committed):
        self.committed = tuple(committed.tolist())
        return super().root(committed)

    def logq(self, path):
        logq = super().logq(path).clone()
        sequence = self.committed + path
        if sequence == tuple(self.reference[: len(sequence)]) and len(sequence) < len(self.reference):
            logq[self.reference[len(sequence)]] += 4.0
        return torch.log_softmax(logq, dim=-1)


def assert_each_generates(target, prompt: torch.Tensor, reference: torch.Tensor, cases: list) -> None:
    """Each (draft, options) case generates exactly `reference` (greedy, no EOS); an `Oracle`'s deep trees
    were verified and accepted."""
    import opttree

    for model_draft, options in cases:
        out = opttree.generate(target, prompt, model_draft, max_new_tokens=reference.shape[1] - prompt.shape[1],
                               eos_token_id=[], **options)
        assert torch.equal(out.sequences, reference), (type(model_draft).__name__, options)
        if isinstance(model_draft, Oracle):
            assert out.stats.mean_accepted_length > 2, out.stats
