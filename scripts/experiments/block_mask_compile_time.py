"""Where the first eager drafter step's start-up time goes, at the benchmark's Qwen3-8B shapes
(4 x 3072 tokens) on cuda:1: create_block_mask and dflash_model.flex_block_mask, eager and
compiled (first and second call), then the first eager step under cProfile.

    TORCHINDUCTOR_CACHE_DIR=/tmp/fresh python scripts/experiments/block_mask_compile_time.py [--skip-create-compiled]

--skip-create-compiled leaves out create_block_mask(_compile=True): 153 s, measured once."""
import cProfile, os, pstats, sys, time
import torch
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
import dflash_model as dm
import benchmark as bm
from transformers import Qwen3Config
from torch.nn.attention.flex_attention import create_block_mask

dev = "cuda:1"
torch.cuda.set_device(dev)
B, A, bs, L = 4, 512, 16, 3072
doc = torch.zeros(B, L, dtype=torch.long, device=dev)
anchors = torch.sort(torch.rand(B, L, device=dev).topk(A, dim=1).indices, dim=1).values
starts = dm.context_starts(anchors, doc)
mm = dm.block_mask_mod(starts, anchors, L, bs)
direct = torch.compile(lambda: dm.flex_block_mask(starts, anchors, L, bs, mm).kv_indices, fullgraph=True)
for label, build in (("create_block_mask eager", lambda: create_block_mask(mm, B, None, A * bs, L + A * bs, device=dev)),
                     ("create_block_mask _compile=True",
                      lambda: create_block_mask(mm, B, None, A * bs, L + A * bs, device=dev, _compile=True)),
                     ("flex_block_mask eager", lambda: dm.flex_block_mask(starts, anchors, L, bs, mm)),
                     ("flex_block_mask compiled", direct)):
    if label == "create_block_mask _compile=True" and "--skip-create-compiled" in sys.argv:
        continue
    for call in ("first", "second"):
        t0 = time.perf_counter()
        build()
        torch.cuda.synchronize()
        print(f"{label}: {call} call {time.perf_counter() - t0:.2f}s", flush=True)

class Args:
    pass
a = Args()
a.max_length, a.rows, a.anchors, a.block, a.draft_layers, a.ce_chunk, a.log_interval = 3072, 4, 512, 16, 5, 4096, 10
a.output_dir = "/tmp/diag"
cfg = Qwen3Config(**bm.PRESETS["qwen3-8b"])
embed = (torch.randn(cfg.vocab_size, cfg.hidden_size, device=dev) * 0.02).to(torch.bfloat16)
w = bm.drafter_worker(a, cfg, dev, embed, embed, 5 * 4096, compile=False)
batch = bm.synthetic_batch(a, cfg.vocab_size, dev, features_dim=5 * 4096)
prof = cProfile.Profile()
t0 = time.perf_counter()
with torch.cuda.stream(w.stream):
    prof.enable()
    w.train_step(1, batch)
    torch.cuda.synchronize()
    prof.disable()
print(f"first eager step: {time.perf_counter() - t0:.1f}s", flush=True)
st = pstats.Stats(prof)
st.sort_stats("cumulative").print_stats(45)
st.sort_stats("tottime").print_stats(15)
