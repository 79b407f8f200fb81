"""The drafter layer's projections that read one input, as separate matmuls (today) or as one
matmul over their concatenated weights, forward + backward (input and weight gradients), bf16, at
the benchmark's Qwen3-8B shapes: 4 x 512 x 16 = 32768 block positions, 4 x 3072 = 12288 context
positions, hidden 4096, 32 query / 8 KV heads of 128, intermediate 12288.

    python scripts/experiments/fused_projections.py

  q/k/v of the block      x [32768, 4096] through q (4096), k (1024), v (1024)
  k/v of the context      c [12288, 4096] through k (1024), v (1024)
  gate/up                 x [32768, 4096] through gate (12288), up (12288)

Prints ms and TFLOP/s per group, separate and fused, and the largest difference of the outputs
and gradients between the two. Then the target stage's forward only (tp.GateUpMLP stacks gate and
up in compiled layers), at its 4 x 3072 = 12288 tokens, twice, since the card's clock moves:

  q/k/v, gate/up          x [12288, 4096], separate and fused, forward only"""
import os, sys
import torch
import torch.nn.functional as F
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from scripts.benchmark import time_cuda

P, T, H, HD, KVD, I = 32768, 12288, 4096, 4096, 1024, 12288
gen = torch.Generator()  # each experiment seeds it


def rand(*shape):
    return (torch.randn(*shape, generator=gen) * 0.02).to("cuda", torch.bfloat16)


def forward_backward(x, weights, grads_out):
    """Outputs, input gradient, weight gradients."""
    ys = [F.linear(x, w) for w in weights]
    g = torch.autograd.grad(ys, [x] + weights, grads_out)
    return ys, g[0], g[1:]


def main():
    gen.manual_seed(0)
    groups = {"q/k/v of the block": (P, [HD, KVD, KVD]), "k/v of the context": (T, [KVD, KVD]),
              "gate/up": (P, [I, I])}
    for name, (rows, outs) in groups.items():
        x = rand(rows, H).requires_grad_()
        weights = [rand(o, H).requires_grad_() for o in outs]
        grads_out = [rand(rows, o) for o in outs]
        flops = 3 * 2 * rows * H * sum(outs)
        # fused: concatenated outside the timed calls (the step folds it into the weights' cast)
        ways = {False: (weights, grads_out),
                True: ([torch.cat(weights).detach().requires_grad_()], [torch.cat(grads_out, -1)])}
        res = {}
        for fused, (ws, gs) in ways.items():
            ys, gx, gws = forward_backward(x, ws, gs)
            res[fused] = [torch.cat(ys, -1), gx, torch.cat(gws)]
            t = time_cuda(lambda: forward_backward(x, ws, gs), 10, "cuda", warmup=2)
            print(f"{name:20s} {'fused' if fused else 'separate':8s}: {t * 1e3:6.2f} ms "
                  f"({flops / t / 1e12:4.0f} TFLOP/s)", flush=True)
        diff = [(a.float() - b.float()).abs().max().item() for a, b in zip(res[False], res[True])]
        print(f"{name:20s} max |diff| output {diff[0]:.3g}, input grad {diff[1]:.3g}, weight grad {diff[2]:.3g}",
              flush=True)


def target_forward():
    gen.manual_seed(0)
    x = rand(T, H)
    for _ in range(2):
        for name, outs in {"q/k/v": [HD, KVD, KVD], "gate/up": [I, I]}.items():
            weights = [rand(o, H) for o in outs]
            stacked = torch.cat(weights)
            flops = 2 * T * H * sum(outs)
            for fused, call in ((False, lambda: [F.linear(x, w) for w in weights]), (True, lambda: F.linear(x, stacked))):
                t = time_cuda(call, 30, "cuda", warmup=5)
                print(f"target {name:13s} {'fused' if fused else 'separate':8s}: {t * 1e3:6.3f} ms "
                      f"({flops / t / 1e12:4.0f} TFLOP/s)", flush=True)


if __name__ == "__main__":
    main()
    target_forward()
