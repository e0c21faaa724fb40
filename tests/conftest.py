import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)  # tiny models: threads only add contention
os.environ["OMP_NUM_THREADS"] = "1"  # and so do the CLI commands the tests run in-process
os.environ["OPTTREE_CACHE_DIR"] = tempfile.mkdtemp(prefix="opttree-test-cache-")  # never the user's profiles
os.environ["OPTTREE_AUTO_CALIBRATE"] = "0"  # no first-use calibration in every CLI test (test_bench tests it)
# a batch's float32 attention is chosen by a timing on first use: off, so that bf16 runs do not depend on this
# machine's timings (tests/test_float32_attention.py turns it on)
os.environ.setdefault("OPTTREE_FLOAT32_ATTENTION", "0")
# a draft's products of a few rows run from int8 copies of its weights, which move its log-probabilities: off, so
# that tests of a drafter's bookkeeping can compare them with its model's forward (tests/test_draft_forward.py
# and tests/test_distribution.py turn them on)
os.environ.setdefault("OPTTREE_DRAFT_INT8", "0")
