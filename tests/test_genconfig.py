import pytest
import torch

import opttree
from helpers import tiny_model


def test_generation_config_processor_refused_by_name():
    """A target whose generation_config sets a logits processor is refused, not silently ignored."""
    target = tiny_model(seed=0)
    target.generation_config.repetition_penalty = 1.3
    with pytest.raises(ValueError, match="repetition_penalty=1.3"):
        opttree.generate(target, torch.tensor([[1, 2, 3]]), tree="ar", max_new_tokens=4)
    target.generation_config.repetition_penalty = None
    opttree.generate(target, torch.tensor([[1, 2, 3]]), tree="ar", max_new_tokens=4)
