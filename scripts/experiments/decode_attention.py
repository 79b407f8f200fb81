"""The regeneration's decode step (dm.BatchDecoder.step, one new token a row, replayed as a CUDA
graph) at the GPU demo's shapes, with candidate attention paths against today's. Today the step is
grouped_attention: SDPA under an additive [rows, 1, q, slots] mask, for which PyTorch picks
cuDNN's kernel; it was 14.0 of 17.7 ms at 1024 rows x 1280 slots (docs/benchmarks.md, sixteenth
session), reading every slot of every row at about half the H200's bandwidth. Candidates:

- sdpa, efficient: the same call with SDPA's memory-efficient kernel forced;
- bmm: two batched matmuls (scores in fp32 from bf16 operands) and a softmax between them;
- flex: the decoder's flex attention (dm.decode_block_mask: 128-slot tiles a row does not use
  yet are skipped; here every row is live): 2.3-2.4x today's step on one H200 (docs/benchmarks.md,
  seventeenth session); on a GPU also with its kernel's stages, warps and tile set;
- compiled layers: today's attention with each decoder layer compiled by inductor (the
  elementwise work around it fused: the step's fixed cost, about 4 ms at 8 rows).

Each runs on the same cache state: prompts of varied length within a chunk (as length_batches
makes them) and rows part-way through their 256 new tokens. Printed: ms per graphed step, and
against today's logits, the largest difference and the share of rows whose greedy token agrees.
SmolLM2-135M-Instruct's shapes with random bf16 weights, or with --model qwen3-8b four layers at
Qwen3-8B's attention shapes (32 query heads over 8, head dim 128: the shapes where flex gets its
decoding kernel); nothing downloaded. On a CPU it runs a two-layer model at one small shape (a
check that every path runs, not a measurement).

    python scripts/experiments/decode_attention.py [--model qwen3-8b]"""
import argparse, contextlib, functools, os, sys, time, traceback
import torch
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
import dflash_model as dm
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda:0" if CUDA else "cpu")
NEW = 256  # new tokens a row decodes (the demo's --regen-max-new-tokens)


def bmm_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    B, H, q, D = query.shape
    Hk, S = key.shape[1], key.shape[2]
    G = H // Hk
    qg = query.reshape(B * Hk, G * q, D)
    kt = key.reshape(B * Hk, S, D).transpose(1, 2)
    if query.is_cuda:  # fp32 scores straight from the bf16 operands (cuBLAS accumulates in fp32)
        scores = torch.bmm(qg, kt, out_dtype=torch.float32)
    else:
        scores = torch.bmm(qg.float(), kt.float())
    scores = scores.view(B, Hk, G * q, S) * (scaling if scaling is not None else D ** -0.5)
    scores = scores + dm.grouped_mask(attention_mask, G).float()
    probs = torch.softmax(scores, -1).to(value.dtype).view(B * Hk, G * q, S)
    out = torch.bmm(probs, value.reshape(B * Hk, S, D)).view(B, H, q, D)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("decode_bmm", bmm_attention)


# name: (Llama config on a GPU, rows x slots measured there). Each target's attention shapes:
# SmolLM2's 9 query heads over 3 run flex_attention's main kernel, Qwen3-8B's 32 over 8 its
# decoding kernel (a power-of-two ratio).
MODELS = {
    "smollm2-135m": (dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True),
                     [(1024, 512), (1024, 1280), (1024, 2304), (64, 2304)]),
    "qwen3-8b": (dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=4, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
                 [(256, 1280), (256, 2304), (64, 2304)]),
}


def build_model(name):
    config = MODELS[name][0]
    if not CUDA:  # two small layers with the same heads: a check that every path runs
        config = dict(config, hidden_size=config["num_attention_heads"] * 16, intermediate_size=256,
                      num_hidden_layers=2, head_dim=16, vocab_size=1024)
    cfg = LlamaConfig(**config, max_position_embeddings=8192, rope_theta=100000.0)
    torch.manual_seed(0)
    with torch.device(DEV):
        return LlamaForCausalLM(cfg).to(torch.bfloat16 if CUDA else torch.float32).eval()


def sync():
    if CUDA:
        torch.cuda.synchronize()


@torch.no_grad()
def prepared(attention, model, rows, slots, seed):
    """A decoder part-way through a chunk: prompt lengths spread over the chunk's last 256 slots
    of prompt, each row 0-255 tokens into its answer (the cache holds the prompts)."""
    g = torch.Generator().manual_seed(seed)
    P = slots - NEW
    lengths = torch.randint(max(1, P - 255), P + 1, (rows,), generator=g)
    vocab = model.config.vocab_size
    d = dm.BatchDecoder(model, rows, slots, graph=CUDA, attention=attention)
    d.prefill([torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in lengths])
    d.next_pos += torch.randint(0, NEW - 1, (rows,), generator=g).to(DEV)
    return d


CANDIDATES = {  # name: (BatchDecoder's attention, another attention for its steps, SDPA backend, compiled layers)
    "sdpa (today)": ("grouped", None, None, False),
    "sdpa, efficient": ("grouped", None, "EFFICIENT_ATTENTION", False),
    "bmm": ("grouped", "decode_bmm", None, False),
    "flex": ("flex", None, None, False),
    "sdpa, compiled layers": ("grouped", None, None, True),
}
# flex's kernel with other stages, warps and tile. Inductor's decoding kernel needs a power-of-two
# number of query heads per kv head (torch 2.11's _use_flex_decoding): SmolLM2's 9 over 3 runs
# flex_attention's main kernel, one program per query head over a padded query tile, while
# Qwen3's and Llama 3.1's 4 would get the decoding kernel.
FLEX_DECODE_OPTIONS = {"flex, 3 stages": {"num_stages": 3},
                       "flex, 3 stages, 4 warps": {"num_stages": 3, "num_warps": 4},
                       "flex, BLOCK_N 128, 3 stages, 4 warps": {"BLOCK_N": 128, "num_stages": 3, "num_warps": 4}}
if CUDA:
    for n, (name, options) in enumerate(FLEX_DECODE_OPTIONS.items()):
        AttentionInterface.register(f"decode_flex_{n}", functools.partial(dm.flex_attention_for_transformers,
                                                                          kernel_options=options))
        CANDIDATES[name] = ("flex", f"decode_flex_{n}", None, False)


def run(model, name, rows, slots, ids, reference):
    attention, step_attention, backend, compile_layers = CANDIDATES[name]
    if backend and not CUDA:  # SDPA's fused kernels are CUDA's
        print(f"  {name:24s} CUDA only", flush=True)
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel
    chosen = sdpa_kernel([getattr(SDPBackend, backend)]) if backend else contextlib.nullcontext()
    for layer in dm.decoder_layers(model):
        layer._compiled_call_impl = None
        if compile_layers:
            layer.compile(dynamic=False)
    d = prepared(attention, model, rows, slots, seed=rows + slots)
    if step_attention:
        d.step_attention = dm.attention_implementation(model, step_attention)
    with chosen, torch.no_grad():
        t0 = time.perf_counter()
        logits = d.step(ids)[0][:, -1].float().clone()  # the first call compiles and captures
        sync()
        first = time.perf_counter() - t0
        n = 50 if CUDA else 2
        t0 = time.perf_counter()
        for _ in range(n):
            d.step(ids)
        sync()
        ms = (time.perf_counter() - t0) / n * 1e3
    d.release()
    if CUDA:
        torch.cuda.empty_cache()
    diff = "" if reference is None else (
        f"; vs today: max |logit diff| {(logits - reference).abs().max().item():.3g}, "
        f"greedy token agrees on {(logits.argmax(-1) == reference.argmax(-1)).float().mean().item():.1%} of rows")
    print(f"  {name:24s} {ms:7.2f} ms/step ({rows / ms * 1e3:9,.0f} tokens/s if every row decodes; first call "
          f"{first:.1f}s){diff}", flush=True)
    return logits


def main():
    # Each decoder layer is its own compiled frame (its layer index is a static int): 30 layers x 4
    # shapes, against dynamo's default of 8 recompiles, past which it silently runs the layer eagerly.
    torch._dynamo.config.recompile_limit = torch._dynamo.config.accumulated_recompile_limit = 1024
    parser = argparse.ArgumentParser(description="The decode step's attention candidates at a target's shapes")
    parser.add_argument("--model", choices=MODELS, default="smollm2-135m")
    args = parser.parse_args()
    model = build_model(args.model)
    shapes = MODELS[args.model][1] if CUDA else [(4, 384)]
    c = model.config
    print(f"decode step: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M-parameter {args.model}-shaped model "
          f"({c.num_hidden_layers} layers, {c.num_attention_heads} query heads over {c.num_key_value_heads}) on {DEV}",
          flush=True)
    for rows, slots in shapes:
        print(f"rows {rows}, slots {slots}:", flush=True)
        ids = torch.randint(0, model.config.vocab_size, (rows, 1), device=DEV)
        reference = None
        for name in CANDIDATES:
            try:
                logits = run(model, name, rows, slots, ids, reference)
                reference = logits if reference is None else reference
            except Exception:
                print(f"  {name:24s} failed: {traceback.format_exc(limit=3)[-600:]}", flush=True)


if __name__ == "__main__":
    main()
