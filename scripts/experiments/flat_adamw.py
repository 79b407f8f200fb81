"""The drafter's optimizer update at Qwen3-8B shapes (1.05B parameters, 58 tensors), each captured
in a CUDA graph with a tensor lr, as the worker runs it: torch's fused capturable AdamW (the clip
as its grad_scale, as the worker used it; and on a gradient clipped beforehand, the reference)
against tp.FlatAdamW (one Triton kernel over flat buffers, which also writes the bf16 weights) at
several (BLOCK, warps). The same gradients and clip go to every variant; the weights after 22
updates are compared with the reference's, and each says whether it wrote the gradient. One GPU.

    python scripts/experiments/flat_adamw.py"""
import os, sys, time
import torch
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
import dflash_model as dm
import train_dflash_pipeline as tp
from transformers import Qwen3Config
import benchmark as bm

cfg = Qwen3Config(**bm.PRESETS["qwen3-8b"])
dev = "cuda:0"
torch.manual_seed(0)
init = [p.detach().clone() for p in dm.DFlashDraftModel(dm.make_drafter_config(cfg, cfg.vocab_size - 1, 5, 16)).to(dev).parameters()]
n = sum(p.numel() for p in init)
grad = torch.randn(n, device=dev, generator=torch.Generator(device=dev).manual_seed(1)) * 1e-3
clip = torch.tensor(0.5, device=dev)


def build(kind):
    params = [p.clone().requires_grad_() for p in init]
    flat_grad = grad * clip if kind == "torch fused, clipped gradient" else grad.clone()
    for p, g in zip(params, tp.flat_views(flat_grad, params)):
        p.grad = g
    lr = torch.tensor(3e-4, device=dev)
    if isinstance(kind, str):
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=True, capturable=True)
        if kind == "torch fused, clip as grad_scale":
            opt.grad_scale = torch.reciprocal(clip)
        return params, flat_grad, opt.step
    opt = tp.FlatAdamW(params, flat_grad, lr, 0.01)
    opt.BLOCK, opt.WARPS = kind
    return params, flat_grad, lambda: opt.step(clip)


def timed(update, n_iter=20):
    s = torch.cuda.Stream(dev)
    torch.cuda.synchronize()  # the buffers were filled on this stream; the updates run on s
    with torch.cuda.stream(s):
        update()  # compiles the kernel, creates state
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            update()
        g.replay(); torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n_iter):
            g.replay()
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n_iter


reference = None
for kind in ["torch fused, clipped gradient", "torch fused, clip as grad_scale",
             (1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 16)]:
    params, flat_grad, update = build(kind)
    given = flat_grad.clone()
    t = timed(update)  # 22 updates
    after = torch.cat([p.detach().reshape(-1) for p in params])
    reference = after if reference is None else reference
    moved = 28 * n + (2 * n if isinstance(kind, tuple) else 0)  # p, g, m, v read; p, m, v (+ bf16) written
    print(f"{str(kind):31s}: {t * 1e3:6.2f} ms an update, {moved / t / 1e12:.2f} TB/s; max |diff| vs the "
          f"first after 22 updates {(after - reference).abs().max().item():.2e}; gradient written: "
          f"{not torch.equal(flat_grad, given)}", flush=True)
    del params, flat_grad, update
    torch.cuda.empty_cache()
