"""AdamW foreach+capturable vs fused (captured in a CUDA graph, tensor lr) on the 1.05B-parameter
drafter at Qwen3-8B shapes, and averaging two 4.2 GB gradient buffers on 2 GPUs: through the
first GPU vs one torch.cuda.nccl.all_reduce. Needs 2 GPUs.

    python scripts/experiments/adamw_and_averaging.py"""
import os, sys, time
import torch
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
import dflash_model as dm
import train_dflash_pipeline as tp
from transformers import Qwen3Config
import benchmark as bm

cfg = Qwen3Config(**bm.PRESETS["qwen3-8b"])
dev = "cuda:1"

def build(kind):
    torch.manual_seed(0)
    d = dm.DFlashDraftModel(dm.make_drafter_config(cfg, cfg.vocab_size - 1, 5, 16)).to(dev)
    params = list(d.parameters())
    flat = torch.zeros(sum(p.numel() for p in params), device=dev)
    at = 0
    for p in params:
        p.grad = flat[at:at + p.numel()].view_as(p); at += p.numel()
    lr = torch.tensor(3e-4, device=dev)
    kw = dict(foreach=True, capturable=True) if kind == "foreach" else \
        dict(fused=True) if kind == "fused" else dict(fused=True, capturable=True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, **kw)
    return d, flat, opt

results = {}
finals = {}
for kind in ("foreach", "fused", "fused_capturable"):
    try:
        d, flat, opt = build(kind)
        g = torch.Generator(device=dev).manual_seed(1)
        s = torch.cuda.Stream(dev)
        with torch.cuda.stream(s):
            for _ in range(3):
                flat.normal_(generator=g); opt.step()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=s):
                opt.step()
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                graph.replay()
            torch.cuda.synchronize()
        results[kind] = (time.perf_counter() - t0) / 20 * 1e3
        finals[kind] = torch.cat([p.detach().flatten()[:1000000] for p in d.parameters()]).cpu()
        print(f"adamw {kind}: {results[kind]:.2f} ms/step (graph replay)", flush=True)
        del d, flat, opt, graph
        torch.cuda.empty_cache()
    except Exception as e:
        print(f"adamw {kind}: error {e!r}"[:400], flush=True)
for k in finals:
    if k != "foreach":
        diff = (finals[k] - finals["foreach"]).abs()
        print(f"adamw {k} vs foreach after 26 steps: max abs diff {diff.max():.3e}, max rel "
              f"{(diff / finals['foreach'].abs().clamp(min=1e-3)).max():.3e}", flush=True)

# averaging: two 1.05B fp32 buffers
n = 1_050_000_000
bufs = [torch.randn(n, device=f"cuda:{i}") for i in range(2)]
ref = (bufs[0].cpu()[:1000] + bufs[1].cpu()[:1000]) / 2
av = tp.GradAverager(2)
av.buffers = bufs
for name, fn in (("copy path", av._average),
                 ("nccl", lambda: (torch.cuda.nccl.all_reduce(bufs), [b.div_(2) for b in bufs],
                                   [torch.cuda.synchronize(b.device) for b in bufs]))):
    fn(); torch.cuda.synchronize(0); torch.cuda.synchronize(1)
    t0 = time.perf_counter()
    for _ in range(10):
        fn()
    torch.cuda.synchronize(0); torch.cuda.synchronize(1)
    print(f"average 2 x 4.2 GB, {name}: {(time.perf_counter() - t0) / 10 * 1e3:.1f} ms", flush=True)
# correctness of nccl path on fresh data
bufs[0].copy_(torch.arange(n, device="cuda:0", dtype=torch.float32)); bufs[1].fill_(1.0)
torch.cuda.nccl.all_reduce(bufs)
print("nccl sum check:", bufs[1][:3].tolist(), bufs[0][-1].item(), flush=True)
