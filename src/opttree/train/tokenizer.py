"""Byte-level BPE tokenizer (GPT-2 style) trained with HF ``tokenizers``, saved as a
``PreTrainedTokenizerFast``. ``decode(encode(x)) == x`` for every string: byte-level, no prefix
space, no normalizer, no clean-up of tokenization spaces."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

EOS = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, out_dir: Path | None = None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS, eos_token=EOS, pad_token=EOS,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
