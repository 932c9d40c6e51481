"""EarlyArrivals: embeddings held for the request they overtook."""

from __future__ import annotations

import time

import torch

from pipeline.generator.early_arrivals import EarlyArrivals


def test_a_request_claims_its_own_embeddings_once_and_unclaimed_ones_expire():
    early = EarlyArrivals(ttl_s=5.0)
    a, b = torch.ones(3, 4), torch.zeros(2, 4)
    early.hold("r1", "k1", a)
    early.hold("r1", "k2", b)
    early.hold("r2", "k1", a)
    assert len(early) == 2
    assert [(k, t.shape) for k, t in early.claim("r1")] == [("k1", (3, 4)), ("k2", (2, 4))]
    assert early.claim("r1") == [] and len(early) == 1
    now = time.monotonic()
    assert early.expire(now) == 0 and len(early) == 1      # not yet
    assert early.expire(now + 6.0) == 1 and len(early) == 0
    assert early.claim("r2") == []
