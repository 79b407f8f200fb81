"""The target's MLP down projection with its residual add, at Qwen3-8B shapes (12,288 tokens,
12,288 -> 4,096, bf16): the matmul then the add (what the compiled layer runs), against cuBLAS's
accumulating matmul (addmm: into a new output, or in place into the residual).

    python scripts/experiments/residual_into_matmul.py

Prints ms, TFLOP/s and the largest error against fp32 per way. On an H100: no faster than the
matmul and the add (docs/benchmarks.md, forty-fifth session)."""
import os, sys
import torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from scripts.benchmark import time_cuda  # noqa: E402

dev = "cuda"
T, I, H = 12288, 12288, 4096
gen = torch.Generator(dev).manual_seed(0)
x = torch.randn(T, I, device=dev, dtype=torch.bfloat16, generator=gen)
w = torch.randn(H, I, device=dev, dtype=torch.bfloat16, generator=gen) / I ** 0.5
residual0 = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=gen)
residual = residual0.clone()
exact = residual0.float() + x.float() @ w.float().t()
ways = {"mm alone": (lambda: x @ w.t(), exact - residual0.float()),
        "mm then add": (lambda: residual + x @ w.t(), exact),
        "addmm (new output)": (lambda: torch.addmm(residual, x, w.t()), exact),
        "addmm_ in place": (lambda: residual.addmm_(x, w.t()), exact)}
for name, (fn, expected) in ways.items():
    residual.copy_(residual0)
    err = (fn().float() - expected).abs().max().item()  # in place: checked on its first call
    t = time_cuda(fn, 30, dev, warmup=5)
    print(f"{name}: {t * 1e3:.3f} ms, {2 * T * I * H / t / 1e12:.0f} TFLOP/s, max err vs fp32 {err:.4f}", flush=True)
