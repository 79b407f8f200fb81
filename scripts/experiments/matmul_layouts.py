"""The drafter step's matmul shapes alone, each in the four operand layouts (A stored M x K or
K x M, B stored K x N or N x K; the output always M x N, row-major), with the cuBLAS kernel each
gets. Default shapes: those in a profile of the Qwen3-8B step (`scripts/benchmark.py --profile F`
writes them to F.matmuls), as M x K x N.

    python scripts/experiments/matmul_layouts.py [--shapes 30720x4096x12288,...] [--iters 20]
    python scripts/experiments/matmul_layouts.py --fp32-out [--shapes ...]

--fp32-out: the weight gradients' shapes instead, each written into an fp32 buffer two ways: a bf16
matmul then its cast copy into the buffer (the step today), or one matmul with an fp32 output
written there (torch.mm's out_dtype).

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
WEIGHT_GRAD_SHAPES = "12288x32768x4096,4096x32768x12288,4096x32768x4096,1024x32768x4096,4096x12288x20480"


def fp32_out(shapes, iters):
    for shape in shapes.split(","):
        M, K, N = map(int, shape.split("x"))
        A = torch.randn(K, M, device="cuda", dtype=torch.bfloat16).t()  # dy^T: the step's layout
        B = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) * 0.02
        into = torch.empty(M, N, device="cuda", dtype=torch.float32)
        cases = {"bf16 matmul, cast copy": lambda: into.copy_(torch.mm(A, B)),
                 "fp32-out matmul": lambda: torch.mm(A, B, out_dtype=torch.float32, out=into)}
        results = {}
        for name, fn in cases.items():
            timed(f"{shape:18s} {name:24s}", fn, 2 * M * K * N, iters)
            results[name] = into.clone()
        a, b = results.values()
        print(f"{shape:18s} max |diff| {(a - b).abs().max().item():.3g} (values up to {b.abs().max().item():.3g})")


def layouts(shape, iters):
    M, K, N = map(int, shape.split("x"))
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    A = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    B = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) * 0.02
    b_layouts = (("KxN", B), ("NxK", B.t().contiguous().t()))  # the same values, stored either way
    for a_stored, A_in in (("MxK", A), ("KxM", A.t().contiguous().t())):
        for b_stored, B_in in b_layouts:
            timed(f"{shape:18s} A {a_stored} B {b_stored}", lambda: torch.mm(A_in, B_in, out=out), 2 * M * K * N, iters)


def timed(label, fn, flop, iters):
    """Prints fn's time, TFLOP/s and the kernels it launches."""
    s = time_cuda(fn, iters, "cuda", warmup=3)
    print(f"{label}: {s * 1e3:7.3f} ms {flop / s / 1e12:5.0f} TFLOP/s  {kernel_of(fn)}", flush=True)


def kernel_of(fn):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return " + ".join(e.key[:60] for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=None, help="MxKxN,...; default: the step's matmuls, or with --fp32-out its "
                   "weight gradients'")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--fp32-out", action="store_true")
    a = p.parse_args()
    if a.fp32_out:
        return fp32_out(a.shapes or WEIGHT_GRAD_SHAPES, a.iters)
    for shape in (a.shapes or STEP_SHAPES).split(","):
        layouts(shape, a.iters)


if __name__ == "__main__":
    main()
