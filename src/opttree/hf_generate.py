"""transformers' own `generate()` as an entry point: `target.generate(..., custom_generate=opttree.custom_generate)`.

transformers 5 accepts a decoding loop as `generate(custom_generate=callable)`: it prepares the inputs,
the generation config, the logits processors and the stopping criteria, then hands the loop over.
`custom_generate` runs opttree's speculative loop in its place, reading the settings from what
transformers prepared, so the output is what `generate` itself would return (token for token at
temperature 0; the same distribution when sampling). `assistant_model=` is the draft (none: the
train-free sources draft); opttree's tree settings (`tree`, `budget`, `delta`, `max_depth`, `drafter`,
`draft_temperature`, `draft_window`, `datastore`, `head`, `depth_control`) may be passed to `generate` as keyword
arguments. The logits processors transformers prepared (a repetition penalty, suppressed tokens, a minimum length, ...) are
applied at every tree node with that node's own context; whatever opttree cannot apply exactly (a time
limit, a logits processor of your own, output scores) is refused by name instead of being ignored. The last call's statistics
are in `opttree.custom_generate.stats`.
"""

from __future__ import annotations

import inspect

import torch
from transformers.generation import logits_process as lp
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .speculator import stream
from .genconfig import Rules, per_node_processors, sampling_settings, stopping_settings
from .grammar import Constraint
from .stats import GenerationStats

# what generate() prepares for every model call; checked below where it could change the output
# (the cache: `past_key_values` before transformers 5.24, `cache` from 5.24)
IGNORED_MODEL_KWARGS = ("use_cache", "attention_mask", "past_key_values", "cache", "cache_position", "position_ids",
                        "logits_to_keep")
UNSUPPORTED_OUTPUTS = ("output_attentions", "output_hidden_states")


def from_generate_call(name: str):
    """An argument of the `generate()` call that called us. transformers passes a custom_generate
    callable neither `assistant_model` nor `streamer`; read from the call, they are honoured, not lost."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "generate" and "custom_generate" in frame.f_locals:
            return frame.f_locals.get(name)
        frame = frame.f_back
    return None


class CustomGenerate:
    """The callable behind `opttree.custom_generate` (see the module's docstring); `.stats` holds the last
    call's GenerationStats."""

    stats: GenerationStats | None = None

    # opttree's settings are named parameters, not **kwargs: transformers' generate refuses any keyword
    # argument that is neither the model's nor a named parameter of the custom_generate callable
    def __call__(self, model, input_ids: torch.Tensor, logits_processor=None, stopping_criteria=None,
                 generation_config=None, assistant_model=None, streamer=None, tree=None,
                 drafter=None, budget=None, delta=None, max_depth=None, draft_temperature=None, draft_window=None,
                 datastore=None, head=None, early_exit=None, depth_control=None, length_predictor=None, seed=None,
                 **model_kwargs):
        unknown = sorted(set(model_kwargs) - set(IGNORED_MODEL_KWARGS))
        if unknown:
            raise ValueError(f"opttree's custom_generate does not pass {unknown} to the model")
        positions, mask = model_kwargs.get("position_ids"), model_kwargs.get("attention_mask")
        if positions is not None and not _own_positions(positions, input_ids, mask):
            raise ValueError("opttree's custom_generate numbers each prompt's positions 0..T-1 (padding left out): "
                             "pass no other position_ids")
        cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        if cache is not None and cache.get_seq_length() > 0:
            raise ValueError("opttree's custom_generate starts from the prompt: pass no filled cache (past_key_values)")
        asked = [name for name in UNSUPPORTED_OUTPUTS if getattr(generation_config, name, False)]
        if asked:
            raise ValueError(f"opttree's custom_generate returns the sequences, logits and scores, not {asked}")
        options = dict(tree=tree, drafter=drafter, budget=budget, delta=delta, max_depth=max_depth,
                       draft_temperature=draft_temperature, draft_window=draft_window, datastore=datastore, head=head,
                       early_exit=early_exit, depth_control=depth_control, length_predictor=length_predictor)
        options = {k: v for k, v in options.items() if v is not None}
        options.update(sampling_settings(logits_processor, bool(generation_config.do_sample)))
        options["num_return_sequences"] = 1  # transformers has repeated the prompts already
        outputs = {name: bool(getattr(generation_config, name) and generation_config.return_dict_in_generate)
                   for name in ("output_logits", "output_scores")}
        if any(outputs.values()) and input_ids.shape[0] > 1:
            raise ValueError("opttree's custom_generate returns output_logits / output_scores for one sequence, not a "
                             "batch (a row that ends early has none for the steps after): generate the rows one at a "
                             "time")
        options.update(outputs)
        stopping = stopping_settings(stopping_criteria, input_ids.shape[-1])
        rules = Rules(per_node_processors(logits_processor), stopping["eos_token_id"])
        if "max_time" in stopping:
            options["max_time"] = stopping["max_time"]
        if seed is None:  # sampling follows torch's global RNG, as transformers' own sampling does
            seed = int(torch.randint(0, 2**62, (1,)))
        draft = assistant_model if assistant_model is not None else from_generate_call("assistant_model")
        streamer = streamer if streamer is not None else from_generate_call("streamer")
        if input_ids.shape[0] > 1:
            sequences = self._batch(model, input_ids, mask, draft, streamer, rules, generation_config,
                                    seed=seed, max_new_tokens=stopping["max_new_tokens"], **options)
        else:
            run = stream(model, input_ids, draft, seed=seed, max_new_tokens=stopping["max_new_tokens"], rules=rules,
                         attention_mask=mask, **options)
            for chunk in run:  # generate() has already put the prompt into the streamer
                if streamer is not None:
                    streamer.put(chunk.cpu())
            if streamer is not None:
                streamer.end()
            self.stats = run.stats
            sequences = run.sequences.to(input_ids.device)
        if generation_config.return_dict_in_generate:  # logits, scores: a (1, V) tensor a new token, as transformers'
            out = run.output() if any(outputs.values()) else None  # (one sequence: `run` is its generation)
            device = input_ids.device
            return GenerateDecoderOnlyOutput(sequences=sequences, logits=_per_token(out and out.logits, device),
                                             scores=_per_token(out and out.scores, device))
        return sequences


    def _batch(self, model, input_ids: torch.Tensor, mask, draft, streamer, rules: Rules, generation_config,
               **options) -> torch.Tensor:
        """A (B, T) batch, padded as its attention mask says: each row decoded as its own prompt, returned
        as `generate` returns a batch: the input rows, then each row's new tokens, padded after its end
        with the pad token up to the longest. `.stats` is then the list of the rows' statistics."""
        if streamer is not None:
            raise ValueError("a streamer takes one sequence (transformers' streamers refuse batches too)")
        padded = mask is not None and not bool(torch.as_tensor(mask).eq(1).all())
        length_bound = [type(p).__name__ for p in rules.processors if isinstance(p, POSITION_COUNTING)]
        if padded and length_bound:
            raise ValueError(f"the logits processors {length_bound} count a padded batch's padding as tokens in "
                             "transformers' generate: opttree decodes each row unpadded and would differ; pass prompts "
                             "of one length, or generate them one at a time")
        batch = input_ids if mask is None else {"input_ids": input_ids, "attention_mask": mask}
        outs = stream(model, batch, draft, rules=rules, **options).finish()
        self.stats = [out.stats for out in outs]
        pad = generation_config.pad_token_id  # transformers' choice when none is set: the first EOS id
        if pad is None:
            pad = rules.eos_token_id[0] if rules.eos_token_id else 0
        longest = max(out.stats.new_tokens for out in outs)
        new = torch.full((len(outs), longest), pad, dtype=input_ids.dtype, device=input_ids.device)
        for row, out in zip(new, outs):
            row[: out.stats.new_tokens] = out.new_tokens.to(input_ids.device)
        return torch.cat([input_ids, new], dim=1)


def _per_token(rows: torch.Tensor | None, device) -> tuple | None:
    """(new, V) -> a (1, V) tensor a new token, as generate returns logits and scores."""
    return None if rows is None else tuple(row[None].to(device) for row in rows)


def _own_positions(positions: torch.Tensor, input_ids: torch.Tensor, mask) -> bool:
    """Whether (B, T) position ids number each row's tokens 0, 1, ... where the attention mask keeps them."""
    keep = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else torch.as_tensor(mask).bool()
    own = keep.long().cumsum(-1) - 1  # (B, T)
    return bool(positions.expand_as(input_ids).cpu()[keep.cpu()].eq(own.cpu()[keep.cpu()]).all())


# processors whose rule reads the sequence's length (padding included, in a padded batch of generate)
# (a grammar's Constraint: where its answer starts)
POSITION_COUNTING = (lp.MinLengthLogitsProcessor, lp.ForcedBOSTokenLogitsProcessor, lp.ForcedEOSTokenLogitsProcessor,
                     lp.ExponentialDecayLengthPenalty, lp.SuppressTokensAtBeginLogitsProcessor, Constraint)

custom_generate = CustomGenerate()
