"""The target's generation_config: refuse the logits processors and stopping criteria opttree does not apply.

`target.generate` builds logits processors (repetition penalty, suppressed tokens, ...) from the model's
generation_config; opttree does not apply them yet, so a config that sets one is refused by name rather
than silently ignored. Override it with `target.generation_config.<field> = <default>` (the value shown).
"""

from transformers import GenerationConfig

# fields whose non-default value changes the tokens target.generate emits (sampling settings aside)
_PROCESSOR_FIELDS = (
    "repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "min_length", "min_new_tokens", "forced_bos_token_id", "forced_eos_token_id",
    "suppress_tokens", "begin_suppress_tokens", "sequence_bias", "exponential_decay_length_penalty",
    "renormalize_logits", "guidance_scale", "watermarking_config", "stop_strings", "max_time",
    "num_beams", "num_beam_groups", "diversity_penalty", "low_memory", "epsilon_cutoff", "eta_cutoff",
    "typical_p", "min_p", "top_h", "penalty_alpha", "dola_layers",
)


def unsupported_settings(generation_config) -> dict[str, tuple[object, object]]:
    """{field: (model's value, default)} for each processor setting opttree would otherwise ignore."""
    if generation_config is None:
        return {}
    defaults = GenerationConfig()
    found = {}
    for name in _PROCESSOR_FIELDS:
        default = getattr(defaults, name, None)
        value = getattr(generation_config, name, default)
        if value != default:
            found[name] = (value, default)
    return found


def check_generation_config(target) -> None:
    """Refuse a target whose generation_config sets a logits processor or stopping criterion opttree does not apply."""
    found = unsupported_settings(getattr(target, "generation_config", None))
    if found:
        settings = ", ".join(f"{k}={v!r}" for k, (v, _) in found.items())
        fixes = "; ".join(f"target.generation_config.{k} = {d!r}" for k, (_, d) in found.items())
        raise ValueError(f"the target's generation_config sets {settings}, which target.generate applies and "
                         f"opttree does not yet; to generate without it, set {fixes}")
