"""The decoding step's stages, in the order data flows through them:

- `drafters`: draft sources (a draft model, a feature head, early exit, token recycling, lookup, a
  datastore) that score candidate children of a node;
- `policies`: tree policies (OPT-Tree, EAGLE-2, DySpec, Sequoia, static trees, chains) that grow the draft
  tree from those scores under a node budget, with `depth` (and `length`, AdaEAGLE's predictor) deciding
  how deep;
- `tree`: the draft tree and its masks;
- `verify`: one target forward over the tree, and acceptance (greedy and sampled) in `sampling`;
- `cache`: KV caches, compacted to the accepted branch; `attention` (layer kinds, windows, positions),
  `rope` (length-switched rope factors), and `chains`, `scan`, `own_state` for models verified as a batch
  of root-to-leaf chains (recurrent state, attention on key indices).

`opttree.engine` runs them step after step; `opttree.settings` holds what configures them.
"""
