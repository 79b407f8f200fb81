"""How far the bf16 training step's loss and gradient are from the fp32 drafter's, on a real
target's features: the rounding that a precision change (such as the residual stream's dtype)
adds to what bf16 autocast already costs, and how far the served drafter (bf16 weights, no
autocast: what eval_acceptance and a server run) is from the training step's forward (train =
serve). The same step on that bf16 copy is the precision the public DFlash trainer (SpecForge)
trains in: a bf16 model, fp32 master weights in its optimizer. Run it in two trees to compare
their rules.

    python scripts/experiments/autocast_error.py [--device cpu] [--drafter DIR] [--seeds 4]

Target: the demo's SmolLM2-135M-Instruct (fetched into the cache by the demo) or --target-model.
Rows: the built-in ShareGPT conversations' documents, packed and padded, and their features,
all by the trainer's own functions (load_corpus, pack_epoch, make_batch, TargetReplica). Drafter: the GPU demo's (5
layers, block 16) with fresh weights, or --drafter (a saved one: a trained drafter's error may
differ). Each seed draws its own anchors (and fresh weights); printed per seed, then the mean."""
import argparse, copy, os, sys
import torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import dflash_model as dm  # noqa: E402
import train_dflash_pipeline as tp  # noqa: E402


def step(drafter, batch, noise, num_anchors, autocast):
    """(loss, the final norm's hidden states as the LM head's matmul reads them, the flat
    gradient), in float64 for comparing."""
    drafter.zero_grad(set_to_none=True)
    # bf16 features (as the target stage hands them) under autocast, else the drafter's own dtype
    feats = batch["features"].to(torch.bfloat16 if autocast else next(drafter.parameters()).dtype)
    hidden = []
    hook = drafter.norm.register_forward_hook(lambda module, args, out: hidden.append(out.detach()))
    try:
        with torch.autocast(feats.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss, _ = drafter(feats, *[batch[k] for k in tp.BATCH_KEYS[1:]], noise, num_anchors=num_anchors)
    finally:
        hook.remove()
    loss.backward()
    hidden = hidden[0].to(torch.bfloat16) if autocast else hidden[0]
    return loss.double(), hidden.double().flatten(), torch.cat([p.grad.double().flatten() for p in drafter.parameters()])


def bf16_copy(drafter, target):
    """The drafter as a server runs it, and as SpecForge trains it: bf16 weights, no autocast."""
    return copy.deepcopy(drafter).to(torch.bfloat16).attach_target(target, torch.bfloat16)


def relative(got, want):
    return ((got - want).norm() / want.norm()).item()


def line(errors):
    loss, hidden, grad, served, bf16_loss, bf16_hidden, bf16_grad = errors
    return (f"autocast's relative error: loss {loss:.2e}, final hidden states {hidden:.3e}, gradient {grad:.3e}; "
            f"the served drafter's final hidden states against autocast's {served:.3e}; "
            f"bf16 weights' (SpecForge's) relative error: loss {bf16_loss:.2e}, final hidden states {bf16_hidden:.3e}, "
            f"gradient {bf16_grad:.3e}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target-model", default=tp.DEFAULT_MODEL)
    p.add_argument("--drafter", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--num-anchors", type=int, default=128)
    p.add_argument("--seeds", type=int, default=4)
    args = p.parse_args()
    device = torch.device(args.device)
    target = tp.load_full_target(args.target_model, "cpu").float()
    saved = dm.DFlashDraftModel.from_pretrained(args.drafter, dtype=torch.float32) if args.drafter else None
    config = saved.config if saved is not None else dm.make_drafter_config(
        target.config, mask_token_id=target.config.vocab_size - 1, num_draft_layers=5, block_size=16)
    # The trainer's own path: its documents, its packing (padded rows), its target stage's features
    corpus = tp.load_corpus([tp.builtin_data_file()], tp.load_tokenizer(args.target_model), args.length,
                            target.config.vocab_size, tp.CACHE, log=lambda *a: None)
    batch = tp.make_batch(corpus, tp.pack_epoch(corpus.lengths, args.length, seed=0, epoch=0)[:args.rows], args.length)
    replica = tp.TargetReplica(target, config.dflash_config["target_layer_ids"], torch.device("cpu"), "dense")
    batch["features"] = replica.features(batch)
    batch = {k: v.to(device) for k, v in batch.items()}
    R, L = batch["input_ids"].shape
    errors = []  # per seed: autocast's (loss, final hidden states, gradient) errors, the served drafter's, bf16 weights'
    for seed in range(args.seeds):
        torch.manual_seed(seed)
        drafter = (saved if saved is not None else dm.DFlashDraftModel(config)).to(device).train().attach_target(target)
        noise = torch.rand(R, L, generator=torch.Generator().manual_seed(seed)).to(device)
        exact = step(drafter, batch, noise, args.num_anchors, False)
        bf16 = step(drafter, batch, noise, args.num_anchors, True)
        bf16_weights = step(bf16_copy(drafter, target), batch, noise, args.num_anchors, False)  # its hidden states: the served ones
        errors.append([relative(b, a) for a, b in zip(exact, bf16)] + [relative(bf16_weights[1], bf16[1])]
                      + [relative(b, a) for a, b in zip(exact, bf16_weights)])
        print(f"seed {seed}: loss {exact[0].item():.5f} (fp32) {bf16[0].item():.5f} (autocast); " + line(errors[-1]),
              flush=True)
    print(f"mean over {args.seeds} seeds: " + line(torch.tensor(errors).mean(0).tolist()))


if __name__ == "__main__":
    main()
