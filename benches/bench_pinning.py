#!/usr/bin/env python
"""How pinning host memory costs on this machine, and what it stalls.

A chunked prompt pins its host copy as it streams in (``icecache.runtime.prefix``). This times,
with torch's pinning setting as the process has it (``PYTORCH_CUDA_ALLOC_CONF``; IceCache's
is ``icecache.runtime.hostmem.PINNING``):

1. ``torch.empty(..., pin_memory=True)`` of 1 MiB to 2 GiB, three fresh blocks each (kept, so
   that torch's host cache serves none of them);
2. the parts of pinning by registering: touching fresh pageable memory, then
   ``cudaHostRegister`` of it;
3. whether pinning on another thread stalls this thread's CUDA work: 200 bf16 4096^2 matmuls
   and 2,000 tiny kernel launches, alone and while a thread pins 64 blocks of 32 MiB.

Compare the two settings in two processes:

    python benches/bench_pinning.py
    PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8 \\
        python benches/bench_pinning.py
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Callable, List

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_index import run_header  # noqa: E402

MiB = 1 << 20


def seconds(fn: Callable[..., object], *args: object) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_pinning needs a CUDA device")
    header, _ = run_header("Pinning host memory", None)
    print(f"{header}\n- torch {torch.__version__}, {torch.cuda.get_device_name()}\n")
    keep: List[torch.Tensor] = []

    def pin(size: int) -> None:
        keep.append(torch.empty(size, dtype=torch.uint8, pin_memory=True))

    torch.cuda.init()
    pin(MiB)
    print("| pinned block | ms, three blocks | GiB/s (best) |\n|---|---|---|")
    for mib in (1, 4, 32, 128, 512, 2048):
        ts = [seconds(pin, mib * MiB) for _ in range(3)]
        print(f"| {mib} MiB | {', '.join(f'{t * 1e3:.1f}' for t in ts)} | {mib / 1024 / min(ts):.1f} |")

    cudart = torch.cuda.cudart()
    print("\n| pageable block | touch ms | cudaHostRegister ms |\n|---|---|---|")
    for mib in (32, 512, 2048):
        x = torch.empty(mib * MiB, dtype=torch.uint8)
        touch = seconds(x.fill_, 0)
        register = seconds(cudart.cudaHostRegister, x.data_ptr(), x.numel(), 0)
        print(f"| {mib} MiB | {touch * 1e3:.1f} | {register * 1e3:.1f} |")
        keep.append(x)

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    counter = torch.zeros(16, device="cuda")

    def matmuls() -> None:
        for _ in range(200):
            a @ a
        torch.cuda.synchronize()

    def launches() -> None:
        for _ in range(2000):
            counter.add_(1)
        torch.cuda.synchronize()

    def pin_on_a_thread(work: Callable[[], None]) -> float:
        thread = threading.Thread(target=lambda: [pin(32 * MiB) for _ in range(64)])
        torch.cuda.synchronize()
        thread.start()
        took = seconds(work)
        thread.join()
        return took

    print("\n| this thread's work | alone ms | while a thread pins 64 x 32 MiB ms |\n|---|---|---|")
    for name, work in (("200 matmuls", matmuls), ("2,000 launches", launches)):
        work()
        print(f"| {name} | {seconds(work) * 1e3:.1f} | {pin_on_a_thread(work) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
