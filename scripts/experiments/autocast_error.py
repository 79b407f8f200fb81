"""How far the bf16 training step's loss and gradient are from the fp32 drafter's, on a real
target's features: the rounding that a precision change (such as the residual stream's dtype)
adds to what bf16 autocast already costs, and how far the served drafter (bf16 weights, no
autocast: what eval_acceptance and a server run) is from the training step's forward (train =
serve). Run it in two trees to compare their rules.

    python scripts/experiments/autocast_error.py [--device cpu] [--drafter DIR] [--seeds 4]

Target: the demo's SmolLM2-135M-Instruct (fetched into the cache by the demo) or --target-model.
Rows: the first built-in ShareGPT conversations, rendered by the target's chat template and
packed as the training data packs them (its loss mask: the replies). Drafter: the GPU demo's (5
layers, block 16) with fresh weights, or --drafter (a saved one: a trained drafter's error may
differ). Each seed draws its own anchors (and fresh weights); printed per seed, then the mean."""
import argparse, copy, json, os, sys
import torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import dflash_model as dm  # noqa: E402
import train_dflash_pipeline as tp  # noqa: E402


def packed_rows(target_name, vocab_size, rows, length):
    """(ids, loss_mask, doc_ids, positions) [rows, length]: the training data's documents of the
    first built-in conversations (tp.row_documents), packed one after another, the last cut."""
    tokenizer, stats = tp.load_tokenizer(target_name), tp.DocumentStats()
    ids, mask, docs, pos = [], [], [], []
    with open(tp.builtin_data_file()) as f:
        for n, line in enumerate(f):
            for t, m in tp.row_documents(json.loads(line), tokenizer, length, vocab_size, None, stats, f"line {n + 1}"):
                docs += [docs[-1] + 1 if docs else 0] * len(t); pos += range(len(t)); ids += t; mask += m
            if len(ids) >= rows * length:
                return [torch.tensor(x[:rows * length]).view(rows, length) for x in (ids, mask, docs, pos)]
    raise SystemExit(f"fewer than {rows} x {length} tokens of documents")


def new_drafter(path, target):
    """The saved drafter at path, else the GPU demo's (5 layers, block 16) with fresh weights."""
    if path:
        return dm.DFlashDraftModel.from_pretrained(path, dtype=torch.float32)
    config = dm.make_drafter_config(target.config, mask_token_id=target.config.vocab_size - 1, num_draft_layers=5,
                                    block_size=16)
    return dm.DFlashDraftModel(config)


def step(drafter, batch, noise, num_anchors, autocast, device):
    """(loss, the final norm's hidden states, the flat gradient), in float64 for comparing."""
    drafter.zero_grad(set_to_none=True)
    feats, ids, loss_mask, doc, pos = batch
    feats = feats.to(torch.bfloat16) if autocast else feats  # the target stage hands bf16 features to autocast
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        loss, _ = drafter(feats, ids, loss_mask, doc, pos, noise, num_anchors=num_anchors)
        with torch.no_grad():
            anchors, _ = drafter.select_anchors(noise, loss_mask, doc, num_anchors)
            hidden = drafter.block_hidden(feats, ids, doc, pos, anchors)
    hidden = hidden.to(torch.bfloat16) if autocast else hidden  # as the LM head's matmul reads them
    loss.backward()
    return loss.double(), hidden.double(), torch.cat([p.grad.double().flatten() for p in drafter.parameters()])


def served_hidden(drafter, target, batch, noise, num_anchors):
    """The final hidden states as a server computes them: bf16 weights, no autocast."""
    served = copy.deepcopy(drafter).to(torch.bfloat16).attach_target(target, torch.bfloat16)
    feats, ids, loss_mask, doc, pos = batch
    with torch.no_grad():
        anchors, _ = served.select_anchors(noise, loss_mask, doc, num_anchors)
        return served.block_hidden(feats.to(torch.bfloat16), ids, doc, pos, anchors).double()


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
    ids, loss_mask, doc_ids, positions = packed_rows(args.target_model, target.config.vocab_size, args.rows,
                                                     args.length)
    layer_ids = new_drafter(args.drafter, target).target_layer_ids
    feats = []
    for r in range(ids.shape[0]):  # each document's features computed on its own, as the target stage does
        for d in doc_ids[r].unique():
            at = doc_ids[r] == d
            with torch.no_grad(), dm.capture_layer_outputs(target, layer_ids) as outs:
                target(ids[r, at][None])
            feats.append(torch.cat(outs, -1)[0])
    R, L = ids.shape
    feats = torch.cat(feats).view(R, L, -1).to(device)
    batch = (feats, ids.to(device), loss_mask.float().to(device), doc_ids.to(device), positions.to(device))
    errors = []  # per seed: autocast's (loss, final hidden states, gradient) errors, the served drafter's
    for seed in range(args.seeds):
        torch.manual_seed(seed)
        drafter = new_drafter(args.drafter, target).to(device).train().attach_target(target)
        noise = torch.rand(R, L, generator=torch.Generator().manual_seed(seed)).to(device)
        exact = step(drafter, batch, noise, args.num_anchors, False, device)
        bf16 = step(drafter, batch, noise, args.num_anchors, True, device)
        served = served_hidden(drafter, target, batch, noise, args.num_anchors)
        errors.append([((b - a).norm() / a.norm()).item() for a, b in zip(exact, bf16)]
                      + [((served - bf16[1]).norm() / bf16[1].norm()).item()])
        print(f"seed {seed}: loss {exact[0].item():.5f} (fp32) {bf16[0].item():.5f} (autocast); " + line(errors[-1]),
              flush=True)
    print(f"mean over {args.seeds} seeds: " + line(torch.tensor(errors).mean(0).tolist()))


def line(errors):
    loss, hidden, grad, served = errors
    return (f"autocast's relative error: loss {loss:.2e}, final hidden states {hidden:.3e}, gradient {grad:.3e}; "
            f"the served drafter's final hidden states against autocast's {served:.3e}")


if __name__ == "__main__":
    main()
