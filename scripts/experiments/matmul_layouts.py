"""The drafter step's matmul shapes alone, each in the four operand layouts (A stored M x K or
K x M, B stored K x N or N x K; the output always M x N, row-major), with the cuBLAS kernel each
gets. Default shapes: those in a profile of the Qwen3-8B step (`scripts/benchmark.py --profile F`
writes them to F.matmuls), as M x K x N.

    python scripts/experiments/matmul_layouts.py [--shapes 30720x4096x12288,...] [--iters 20]

Alone, the GPU runs near its top clock; in the step it is held at its power limit, so compare
layouts of one shape here, and the step's rates in F.matmuls."""
import argparse, os, sys
import torch
from torch.profiler import ProfilerActivity, profile
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from scripts.benchmark import time_cuda

STEP_SHAPES = ("32768x4096x12288,30720x4096x12288,32768x12288x4096,30720x12288x4096,32768x4096x4096,"
               "30720x4096x4096,4096x4096x151936,2048x4096x151936,4096x151936x4096,32768x4096x1024,"
               "32768x1024x4096,12288x32768x4096,4096x32768x12288,4096x32768x4096,12288x30720x4096,"
               "4096x30720x12288")


def kernel_of(fn):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return " + ".join(e.key[:60] for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=STEP_SHAPES, help="MxKxN,...")
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    for shape in a.shapes.split(","):
        M, K, N = map(int, shape.split("x"))
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        for a_stored in ("MxK", "KxM"):
            for b_stored in ("KxN", "NxK"):
                A = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                B = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) * 0.02
                A = A if a_stored == "MxK" else A.t().contiguous().t()
                B = B if b_stored == "KxN" else B.t().contiguous().t()
                fn = lambda: torch.mm(A, B, out=out)  # noqa: E731
                s = time_cuda(fn, a.iters, "cuda", warmup=3)
                print(f"{shape:18s} A {a_stored} B {b_stored}: {s * 1e3:7.3f} ms {2 * M * K * N / s / 1e12:5.0f} TFLOP/s  "
                      f"{kernel_of(fn)}", flush=True)
                del A, B


if __name__ == "__main__":
    main()
