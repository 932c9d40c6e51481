"""The generator's engine: a continuous-batching loop over a paged KV cache.

The scheduler side is plain CPU bookkeeping built from small parts, each
testable alone:
- kv_blocks: the paged KV block pool;
- request: sampling parameters, image spans, a request's mutable state;
- encoder_cache: image embeddings held locally until their spans are consumed;
- scheduler: one step's plan under the token, sequence, KV block, encoder
  cache and (aggregated mode) local encode budgets.
"""
