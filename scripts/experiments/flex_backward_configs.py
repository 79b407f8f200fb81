"""flex_attention forward/backward time for one kernel_options setting, at the drafter's shapes in
the benchmark (4 rows x 3072 tokens, 512 anchors x block 16, 32 heads / 8 KV heads, head_dim 128).

    python scripts/experiments/flex_backward_configs.py IDX 'JSON_OPTIONS' cuda:N

Compiles, saves the output and gradients to /tmp/exp/flex_IDX.pt (for comparing settings), then
times 20 forward and 20 forward+backward calls holding a per-GPU file lock, so several settings
can compile side by side (sweep_flex_backward.sh) and still be timed one at a time."""
import fcntl, json, os, sys, time
import torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import dflash_model as dm
from scripts.experiments.drafter_attention_variants import B, L, bs, drafter_attention_case
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

idx, opts, dev = int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
mask_bs = opts.pop("MASK_BLOCK", None)
torch.cuda.set_device(dev)
c = drafter_attention_case(dev)
anchors, q, k, v, gout, Q, S = c.anchors, c.q, c.k, c.v, c.gout, c.Q, c.S
mask_mod = dm.block_mask_mod(dm.context_starts(anchors, c.doc), anchors, L, bs)

kw = {} if mask_bs is None else {"BLOCK_SIZE": tuple(mask_bs)}
t0 = time.perf_counter()
bm = create_block_mask(mask_mod, B, None, Q, S, device=dev, **kw)
fa = torch.compile(flex_attention, dynamic=False)
res = {"idx": idx, "opts": opts, "mask_block": mask_bs}
try:
    def fwd():
        return fa(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=dict(opts) or None)
    def fwdbwd():
        out = fwd()
        out.backward(gout)
        return out
    out = fwdbwd()
    torch.cuda.synchronize()
    res["compile_s"] = time.perf_counter() - t0
    torch.save({"out": out.detach().cpu(), "dq": q.grad.cpu(), "dk": k.grad.cpu(), "dv": v.grad.cpu()},
               f"/tmp/exp/flex_{idx}.pt")
    with open(f"/tmp/exp/lock_{dev[-1]}", "w") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        for fn in (fwd, fwdbwd):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record()
            for _ in range(20):
                q.grad = k.grad = v.grad = None
                fn()
            ev[1].record()
            torch.cuda.synchronize()
            res[fn.__name__ + "_ms"] = ev[0].elapsed_time(ev[1]) / 20
        res["bwd_ms"] = res["fwdbwd_ms"] - res["fwd_ms"]
except Exception as e:
    res["error"] = repr(e)[:300]
print("RESULT " + json.dumps(res), flush=True)
