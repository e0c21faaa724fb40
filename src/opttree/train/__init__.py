"""Training tooling: corpus, byte-level BPE tokenizer, Llama LM pretraining and draft distillation.

Nothing heavy is imported here; import the submodules (``opttree.train.lm`` etc.) when needed.
The command-line entry is ``opttree train ...`` (see ``opttree.train.cli``) and docs/TRAINING.md.
"""

__all__ = ["corpus", "tokenizer", "lm", "distill", "cli"]
