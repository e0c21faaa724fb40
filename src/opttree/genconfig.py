"""What `target.generate` would apply beyond the model's logits, applied node by node (docs/USAGE.md, "Python").

transformers builds logits processors (repetition penalty, suppressed tokens, forced EOS, ...) and
stopping criteria from the model's generation_config and the call's settings. opttree lets transformers
prepare them (a `generate(custom_generate=...)` call whose decoding loop only records what it is handed),
then applies each processor to every verified row with that row's own context: the committed tokens,
then the path from the root to the node. Greedy choices and sampled distributions are then those of
`target.generate`, node for node. Warpers (temperature, top-k, top-p, min-p, typical, epsilon, eta, top-h) become
opttree's own settings; stop strings and EOS become the Stopper's. What opttree cannot apply exactly is refused by name.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import transformers
from transformers.generation import logits_process as lp
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria

from .grammar import Constraint
from .settings.arguments import eos_list
from .step.tree import DraftTree, node_paths

class OutputPenalties(lp.LogitsProcessor):
    """OpenAI's presence and frequency penalties, as vLLM applies them: each token's logit is lowered by
    `presence` if it occurs among the tokens generated so far and by `frequency` times its count there (the
    first `prompt_len` tokens, the prompt, are not counted). A pure function of the context, applied per node."""

    def __init__(self, prompt_len: int, presence: float = 0.0, frequency: float = 0.0):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.prompt_len:]  # (B, T - P)
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)  # (B, V)


# Processors that are pure functions of (context ids, scores): exact when each row gets its own context.
PER_NODE = (OutputPenalties, Constraint,
    lp.RepetitionPenaltyLogitsProcessor, lp.EncoderRepetitionPenaltyLogitsProcessor, lp.NoRepeatNGramLogitsProcessor,
    lp.EncoderNoRepeatNGramLogitsProcessor, lp.NoBadWordsLogitsProcessor, lp.SequenceBiasLogitsProcessor,
    lp.MinLengthLogitsProcessor, lp.MinNewTokensLengthLogitsProcessor, lp.ForcedBOSTokenLogitsProcessor,
    lp.ForcedEOSTokenLogitsProcessor, lp.InfNanRemoveLogitsProcessor, lp.ExponentialDecayLengthPenalty,
    lp.SuppressTokensLogitsProcessor, lp.SuppressTokensAtBeginLogitsProcessor, lp.LogitNormalization,
)
# generation_config fields that add one of PER_NODE (the dry generate() call is made only if one is set)
PER_NODE_FIELDS = (
    "repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "sequence_bias", "min_length", "min_new_tokens", "forced_bos_token_id", "forced_eos_token_id",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    "renormalize_logits",
)
# settings that change the tokens and that opttree does not apply: {field: what it needs}
REFUSED_FIELDS = {
    "guidance_scale": "classifier-free guidance (a second, unconditional forward)",
    "watermarking_config": "watermarking",
    "num_beams": "beam search", "num_beam_groups": "group beam search", "diversity_penalty": "group beam search",
    "penalty_alpha": "contrastive search", "dola_layers": "DoLa decoding", "low_memory": "contrastive search",
    "token_healing": "token healing (it rewrites the prompt's last tokens before generating)",
}
# the warpers opttree applies with transformers' own objects (`opttree.step.sampling.Warp`), as generate builds them
# when sampling: field -> (the warper, its attribute that holds the setting, whether generate applies the value)
OWN_WARPERS = {
    "min_p": (lp.MinPLogitsWarper, "min_p", lambda v: True),
    "typical_p": (lp.TypicalLogitsWarper, "mass", lambda v: v < 1),
    "epsilon_cutoff": (lp.EpsilonLogitsWarper, "epsilon", lambda v: 0 < v < 1),
    "eta_cutoff": (lp.EtaLogitsWarper, "epsilon", lambda v: 0 < v < 1),
    "top_h": (lp.TopHLogitsWarper, "top_h", lambda v: True),
}
# what `generate` applies where neither the caller nor the generation_config sets a value (transformers' own table)
GENERATE_DEFAULTS = transformers.GenerationConfig._get_default_generation_params()
# values that mean "off" (None and False always do)
NEUTRAL = {"guidance_scale": 1.0, "num_beams": 1, "num_beam_groups": 1, "diversity_penalty": 0.0, "typical_p": 1.0,
           "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0,
           "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "min_length": 0, "min_new_tokens": 0}


@dataclass(frozen=True)
class Rules:
    """What a generation applies beyond the logits: per-node processors (transformers' objects, in
    generate's order), EOS ids and stop strings."""

    processors: tuple = ()
    eos_token_id: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)


def shape_logits(processors, committed: torch.Tensor, tree: DraftTree, logits: torch.Tensor) -> torch.Tensor:
    """Apply `processors` to each verified row with its own context, as `target.generate` would there.

    committed: (T,) prompt + emitted (its last token is the root); logits: (N + 1, V) at [root] + nodes.
    Row 0's context is `committed`; node i's is `committed` + the tokens from the root down to node i.
    Rows of one depth share a context length and go through the processors as one batch.
    Returns (N + 1, V) float32 scores (transformers processes float32 copies too)."""
    if not processors:
        return logits
    scores = logits.float().clone()  # (N+1, V)
    tails = [()] + node_paths(tree)  # row r's tokens after the root
    depths = [0] + tree.depths.tolist()
    for depth in sorted(set(depths)):
        rows = [r for r, d in enumerate(depths) if d == depth]
        tail = torch.tensor([tails[r] for r in rows], dtype=torch.long, device=committed.device).view(len(rows), depth)
        context = torch.cat([committed.expand(len(rows), -1), tail], dim=1)  # (R, T + depth)
        out = scores[rows]  # (R, V) a copy: processors may write in place
        for processor in processors:
            out = processor(context, out)
        scores[rows] = out
    return scores


def config_refusals(generation_config) -> dict[str, object]:
    """{field: value} for settings in the generation_config that opttree does not apply."""
    found = {}
    for name in REFUSED_FIELDS:
        if _is_set(generation_config, name):
            found[name] = getattr(generation_config, name)
    if getattr(generation_config, "cache_implementation", None) == "quantized":
        found["cache_implementation"] = "quantized"
    return found


def check_config(generation_config) -> None:
    found = config_refusals(generation_config)
    if found:
        settings = ", ".join(f"{k}={v!r}" for k, v in found.items())
        fixes = "; ".join(f"target.generation_config.{k} = None" for k in found)
        raise ValueError(f"the target's generation_config sets {settings}, which target.generate applies and "
                         f"opttree cannot apply exactly ({', '.join(REFUSED_FIELDS.get(k, k) for k in found)}); "
                         f"to generate without it, set {fixes}")


def config_defaults(generation_config, given: dict, prompt_len: int | None = None) -> dict:
    """The generation_config's sampling settings and length, for the ones the caller did not give. As in
    target.generate, they sample only if `do_sample` is set there (a temperature alone does not), and a `max_length`
    there counts the prompt (`prompt_len`; None: checked before any prompt, the length is left for later)."""
    defaults: dict = {}
    sampling = given.get("temperature", 0.0) > 0 if "temperature" in given else bool(generation_config.do_sample)
    if "temperature" not in given and sampling:
        defaults["temperature"] = float(generation_config.temperature or 1.0)
    if sampling and "top_k" not in given:  # the config's, else the one generate itself falls back on (50)
        top_k = generation_config.top_k
        defaults["top_k"] = int(top_k if top_k is not None else GENERATE_DEFAULTS["top_k"])
    if sampling and "top_p" not in given and generation_config.top_p is not None:
        defaults["top_p"] = float(generation_config.top_p)
    for name, (_, _, applies) in OWN_WARPERS.items():
        value = getattr(generation_config, name, None)
        if sampling and name not in given and value is not None and applies(value):
            defaults[name] = float(value)
    if "max_new_tokens" not in given and generation_config.max_new_tokens is not None:
        defaults["max_new_tokens"] = int(generation_config.max_new_tokens)
    elif "max_new_tokens" not in given and generation_config.max_length is not None and prompt_len is not None:
        room = int(generation_config.max_length) - prompt_len
        if room < 1:
            raise ValueError(f"the generation_config's max_length={generation_config.max_length} leaves no room after "
                             f"the {prompt_len}-token prompt: pass max_new_tokens")
        defaults["max_new_tokens"] = room
    if "max_time" not in given and generation_config.max_time is not None:
        defaults["max_time"] = float(generation_config.max_time)
    return defaults


def prepare(target, generation_config, ids: torch.Tensor, config, eos_token_id: list[int] | None, stop: list[str],
            tokenizer, logits_processor=None) -> Rules:
    """The Rules of `target.generate(ids, generation_config=..., max_new_tokens=..., eos_token_id=...,
    logits_processor=...)`. config: the call's SpecConfig (defaults filled in)."""
    check_config(generation_config)
    if not stop and generation_config.stop_strings:
        stop = generation_config.stop_strings
        stop = [stop] if isinstance(stop, str) else list(stop)
        if tokenizer is None:
            raise ValueError(f"the target's generation_config sets stop_strings={stop!r}, which need the tokenizer: "
                             "pass tokenizer=... (or set target.generation_config.stop_strings = None)")
    if eos_token_id is None:
        eos_token_id = eos_list(generation_config.eos_token_id)
    processors: tuple = ()
    if logits_processor or any(_is_set(generation_config, name) for name in PER_NODE_FIELDS):
        prepared = _dry_generate(target, generation_config, ids, config.max_new_tokens, eos_token_id, logits_processor)
        processors = per_node_processors(prepared)
    return Rules(processors, eos_token_id, list(stop))


def per_node_processors(logits_processor) -> tuple:
    """transformers' prepared processors, checked: each must be one opttree applies per node."""
    kept = []
    for processor in logits_processor or []:
        if isinstance(processor, (lp.TemperatureLogitsWarper, lp.TopKLogitsWarper, lp.TopPLogitsWarper,
                                  *(warper for warper, _, _ in OWN_WARPERS.values()))):
            continue  # the sampling settings (`sampling_settings`): opttree applies them after these (as generate does)
        if not isinstance(processor, PER_NODE):
            raise ValueError(f"opttree does not apply the logits processor {type(processor).__name__}, which this "
                             "generation would use: it is not known to depend only on the tokens before each position")
        if isinstance(processor, lp.RepetitionPenaltyLogitsProcessor) and isinstance(processor.prompt_ignore_length,
                                                                                     torch.Tensor):
            if processor.prompt_ignore_length.any():
                raise ValueError("a repetition penalty that skips padding: opttree decodes one unpadded sequence")
            processor = lp.RepetitionPenaltyLogitsProcessor(processor.penalty)  # nothing to skip: the same processor
        kept.append(processor)
    return tuple(kept)


def sampling_settings(logits_processor, do_sample: bool) -> dict:
    """temperature, top_k, top_p and the other warpers opttree applies (OWN_WARPERS) from transformers' prepared
    warpers (the other processors: see `per_node_processors`, which refuses what opttree does not apply)."""
    settings = dict(temperature=1.0 if do_sample else 0.0, top_k=0, top_p=1.0)
    for processor in logits_processor or []:
        if isinstance(processor, lp.TemperatureLogitsWarper):
            settings["temperature"] = float(processor.temperature)
        elif isinstance(processor, lp.TopKLogitsWarper):
            settings["top_k"] = int(processor.top_k)
        elif isinstance(processor, lp.TopPLogitsWarper):
            if processor.min_tokens_to_keep != 1:
                raise ValueError("top_p with min_tokens_to_keep > 1 (beam search): opttree keeps one token at least")
            settings["top_p"] = float(processor.top_p)
        for name, (warper, attribute, _) in OWN_WARPERS.items():
            if isinstance(processor, warper):
                if getattr(processor, "min_tokens_to_keep", 1) != 1:
                    raise ValueError(f"{name} with min_tokens_to_keep > 1 (beam search): opttree keeps one token "
                                     "at least")
                settings[name] = float(getattr(processor, attribute))  # eta's: a 0-d float32 tensor
    if not do_sample:
        settings["temperature"] = 0.0
    return settings


def stopping_settings(stopping_criteria, prompt_len: int) -> dict:
    """max_new_tokens, EOS ids and max_time from transformers' prepared stopping criteria; any other criterion is
    refused."""
    settings: dict = dict(eos_token_id=[])
    for criterion in stopping_criteria or []:
        if isinstance(criterion, MaxLengthCriteria):
            settings["max_new_tokens"] = criterion.max_length - prompt_len
        elif isinstance(criterion, EosTokenCriteria):
            settings["eos_token_id"] = criterion.eos_token_id.tolist()
        elif isinstance(criterion, MaxTimeCriteria):
            settings["max_time"] = float(criterion.max_time)
        else:  # stop strings included: transformers hands a custom_generate call no tokenizer for them
            raise ValueError(f"opttree does not apply the stopping criterion {type(criterion).__name__}, which this "
                             "generation would use")
    if "max_new_tokens" not in settings:
        raise ValueError("generate() set no maximum length: pass max_new_tokens")
    return settings


def _is_set(config, name: str) -> bool:
    value = getattr(config, name, None)
    return value is not None and value is not False and value != NEUTRAL.get(name)


def _record(model, input_ids, logits_processor=None, **_):
    return logits_processor  # the dry call's decoding loop: hand back what generate() prepared


def _dry_generate(target, generation_config, ids: torch.Tensor, max_new_tokens: int, eos_token_id: list[int],
                  logits_processor):
    """The logits processors `target.generate` prepares for this prompt (no forward pass is run)."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # generate's notes on pad tokens and unused settings
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return target.generate(ids[None], generation_config=generation_config, custom_generate=_record,
                                   max_new_tokens=max_new_tokens, do_sample=False,
                                   eos_token_id=eos_token_id or None, logits_processor=logits_processor)
    except ValueError as error:
        raise ValueError(f"transformers refuses these generation settings for this model: {error}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
