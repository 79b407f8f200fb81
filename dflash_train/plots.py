"""The plots a run writes beside its log: training curves and the acceptance histogram."""

import json
import os

import numpy as np

def run_records(out_dir, log=print):
    """A run directory's metrics.jsonl records and its final evaluation report (None if none).
    A line that is not a whole record (a kill or a full disk mid-write) is skipped and said; a
    missing metrics.jsonl is said and read as no records."""
    recs, path = [], os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        log(f"metrics: {path} does not exist; no training records to read")
    with open(path) if os.path.exists(path) else open(os.devnull) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                recs.append(json.loads(line))
            except ValueError:
                log(f"metrics: {out_dir}/metrics.jsonl:{lineno} is not a whole record (torn by a kill or a full "
                    "disk?); skipped")
    report_path = os.path.join(out_dir, "final", "eval_acceptance.json")
    final = None
    if os.path.exists(report_path):
        with open(report_path) as f:
            final = json.load(f)
    return recs, final


def write_plots(out_dir, log=print):
    """PNG plots beside the log: training loss, tau_hat and per-slot accuracy over steps (with the
    measured acceptance where --eval-interval logged it), and the acceptance histogram of the
    final evaluation next to prompt lookup's. Needs matplotlib; without it, says so."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("plots: matplotlib is not installed; no plots written")
        return []
    recs, final = run_records(out_dir, log)
    train = [r for r in recs if "loss" in r]
    evals = [r for r in recs if "eval_acceptance_length" in r]
    written = []
    if train:
        fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
        steps = [r["step"] for r in train]
        ax[0].plot(steps, [r["loss"] for r in train])
        ax[0].set(title="training loss", xlabel="step", yscale="log")
        ax[1].plot(steps, [r["tau_hat"] for r in train], label="tau_hat (training)")
        vals = [r for r in recs if "val_tau_hat" in r]
        if vals:
            ax[0].plot([r["step"] for r in vals], [r["val_loss"] for r in vals], "o-", label="validation")
            ax[0].legend()
            ax[1].plot([r["step"] for r in vals], [r["val_tau_hat"] for r in vals], "o-", label="tau_hat (validation)")
            for key, name in (("val_acceptance_length", "decoding replayed (validation)"),
                              ("val_acceptance_length_first_answers", "decoding replayed, first answers")):
                replayed = [r for r in vals if key in r]
                if replayed:
                    ax[1].plot([r["step"] for r in replayed], [r[key] for r in replayed], "o-", label=name)
        if final is not None:
            evals = evals + [{"step": steps[-1], "eval_acceptance_length": final["acceptance_length"]}]
        if evals:
            ax[1].plot([r["step"] for r in evals], [r["eval_acceptance_length"] for r in evals], "s",
                       label="measured acceptance (held-out prompts)")
        ax[1].set(title="acceptance length", xlabel="step")
        ax[1].legend(loc="upper left")  # the curves rise to the right; the measured points sit low there
        slots = np.asarray([r["acc_per_slot"] for r in train])
        for k in range(0, slots.shape[1], max(1, slots.shape[1] // 5)):
            ax[2].plot(steps, slots[:, k], label=f"slot {k + 1}")
        ax[2].set(title="accuracy per block slot", xlabel="step", ylim=(0, 1))
        ax[2].legend()
        fig.tight_layout()
        written.append(os.path.join(out_dir, "training.png"))
        fig.savefig(written[-1], dpi=90)
        plt.close(fig)
    if final is not None:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for key, name, shift in (("histogram", f"drafter (mean {final['acceptance_length']:.2f})", -0.2),
                                 ("prompt_lookup_histogram",
                                  f"prompt lookup (mean {final['prompt_lookup_acceptance_length']:.2f})", 0.2)):
            h = {int(k): v for k, v in final[key].items()}
            total = max(sum(h.values()), 1)
            ax.bar([k + shift for k in h], [v / total for v in h.values()], width=0.4, label=name)
        ax.set(title="tokens per verification step", xlabel="accepted length", ylabel="share of steps")
        ax.legend()
        fig.tight_layout()
        written.append(os.path.join(out_dir, "acceptance.png"))
        fig.savefig(written[-1], dpi=90)
        plt.close(fig)
    log(f"plots: {', '.join(written) or 'nothing to plot'}")
    return written
