"""Where the drafter's RoPE cos/sin come from, in one compiled layer's q path (q_norm, RoPE) forward
and backward, at the benchmark's Qwen3-8B shapes: 4 rows x 8192 block positions, 32 heads of 128.

Compiled, `rotary_emb(x, positions)` inside the graph is fused into every consumer: inductor
computes cos and sin per element, so once per head (see the output code of any compiled drafter
step: `.cos()` and `.sin()` inside the loop over heads). The step's kernels with cos and sin in
their names took about 11 ms (docs/benchmarks.md, twenty-third session). Three ways, compiled:

  inside   today: cos/sin = the rotary embedding of the positions, inside the compiled function
  table    cos/sin gathered from a [positions, head_dim] table built outside it
  given    cos/sin [B, Q, head_dim] built outside it and passed in
  opaque   as inside, then through an opaque copy (a custom op): inductor has to compute them once
           per position, into a buffer, instead of in each consumer

    python scripts/experiments/rope_recompute.py [--device cpu --rows 1 --positions 256]

Prints ms forward+backward per way, and the largest difference of output and gradient against
`inside`."""
import argparse, os, sys
import torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import dflash_model as dm
from scripts.benchmark import PRESETS, time_cuda
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding


@torch.library.custom_op("dflash_experiment::computed_once", mutates_args=())
def computed_once(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return cos.clone(), sin.clone()


@computed_once.register_fake
def _(cos, sin):
    return torch.empty_like(cos), torch.empty_like(sin)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--positions", type=int, default=512 * 16, help="block positions a row")
    p.add_argument("--max-position", type=int, default=3072 + 16)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    dev = torch.device(a.device)
    cfg = Qwen3Config(**PRESETS["qwen3-8b"])
    H, D = cfg.num_attention_heads, cfg.head_dim
    rotary = Qwen3RotaryEmbedding(cfg).to(dev)
    q_norm = dm.RMSNorm(D, cfg.rms_norm_eps).to(dev)
    g = torch.Generator().manual_seed(0)
    B, Q = a.rows, a.positions
    q_proj_out = torch.randn(B, Q, H * D, generator=g).to(dev, torch.bfloat16).requires_grad_()
    positions = torch.randint(0, a.max_position, (B, Q), generator=g).to(dev)
    grad_out = torch.randn(B, H, Q, D, generator=g).to(dev, torch.bfloat16)
    x32 = torch.empty(1, device=dev)  # rotary_emb reads only its dtype and device
    table_cos, table_sin = rotary(x32, torch.arange(a.max_position, device=dev)[None])
    table_cos, table_sin = table_cos[0], table_sin[0]

    def q_path(cos, sin):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            q = q_norm(q_proj_out.view(B, Q, H, D)).transpose(1, 2)
            return dm.apply_rope(q, cos, sin)

    ways = {
        "inside": lambda pos: q_path(*rotary(x32, pos)),
        "table": lambda pos: q_path(table_cos[pos], table_sin[pos]),
        "given": lambda pos, cs=rotary(x32, positions): q_path(*cs),
        "opaque": lambda pos: q_path(*computed_once(*rotary(x32, pos))),
    }
    ref = None
    for name, fn in ways.items():
        step = torch.compile(fn, fullgraph=True, dynamic=False)

        def fwd_bwd():
            q_proj_out.grad = None
            out = step(positions)
            out.backward(grad_out)
            return out.detach(), q_proj_out.grad
        got = fwd_bwd()
        ref = ref or got
        diff = [(x.float() - y.float()).abs().max().item() for x, y in zip(got, ref)]
        t = time_cuda(fwd_bwd, a.iters, dev, warmup=2) if dev.type == "cuda" else float("nan")
        print(f"{name:7s}: forward+backward {t * 1e3:6.3f} ms; max |diff| vs inside: out {diff[0]:.3g}, "
              f"grad {diff[1]:.3g}", flush=True)


if __name__ == "__main__":
    main()
