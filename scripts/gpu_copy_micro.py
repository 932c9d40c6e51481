#!/usr/bin/env python3
"""The floor under an arena read, in one process: host time to queue a
device copy and time until it completed, on one GPU and between two, with
nothing else on either GPU. Run on the GPU box: python scripts/gpu_copy_micro.py
"""

from __future__ import annotations

import statistics
import sys
import time

import torch



def timed(fn, iters=300):
    queue, total = [], []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        t1 = time.perf_counter_ns()
        torch.cuda.current_stream().synchronize()
        t2 = time.perf_counter_ns()
        queue.append(t1 - t0)
        total.append(t2 - t0)
    skip = iters // 10
    return statistics.median(queue[skip:]) / 1e3, statistics.median(total[skip:]) / 1e3


def main() -> int:
    n = torch.cuda.device_count()
    print("devices", n, [torch.cuda.get_device_name(i) for i in range(n)])
    for a in range(n):
        for b in range(n):
            if a != b:
                print(f"peer access {a}->{b}: {torch.cuda.can_device_access_peer(a, b)}")
    for mib in (2, 8):
        nbytes = mib << 20
        for src_dev in range(min(n, 2)):
            torch.cuda.set_device(0)
            src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=f"cuda:{src_dev}")
            dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
            tag = f"{mib} MiB cuda:{src_dev}->cuda:0"
            q, t = timed(lambda: dst.copy_(src, non_blocking=True))
            print(f"{tag} Tensor.copy_:        queue {q:7.1f} us  done {t:7.1f} us  ({nbytes / t / 1e3:.0f} GB/s)")
            assert torch.equal(dst.cpu(), src.cpu())
            q, t = timed(lambda: torch.cuda.Event().record())
            print(f"{tag} Event()+record:      queue {q:7.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
