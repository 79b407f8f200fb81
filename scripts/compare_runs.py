"""Several training runs side by side: the held-out figures and the measured acceptance over
steps, the learning rate each followed, and a table of where each ended. For sweeps (schedules,
learning rates, data): one plot instead of one per run directory.

    python scripts/compare_runs.py runs/steps6000 runs/wsd6000 runs/lr2e3 --out compare.png [--x minutes]

Each argument is a run's --output-dir (its metrics.jsonl, and final/eval_acceptance.json when
the run finished its evaluation). Needs matplotlib for the plot; the table prints without it.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dflash_train import plots  # noqa: E402


def summary(name, recs, final):
    """One table row: the last held-out figures and the measured acceptance."""
    train = [r for r in recs if "loss" in r]
    vals = [r for r in recs if "val_tau_hat" in r]
    evals = [r for r in recs if "eval_acceptance_length" in r]
    last_val = vals[-1] if vals else {}
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    measured = " ".join(f"{r['eval_acceptance_length']:.2f}@{r['step']}" for r in evals) or "-"
    first_answers = last_val.get("val_acceptance_length_first_answers")
    sampled = (final or {}).get("sampled") or {}
    return (f"{name:<24} {train[-1]['step'] if train else 0:>6} {fmt(last_val.get('val_tau_hat')):>8} "
            f"{fmt(last_val.get('val_acceptance_length')):>9} {fmt(first_answers):>9} {measured:>14} "
            f"{fmt(final and final['acceptance_length']):>6} "
            f"{fmt(final and final['prompt_lookup_acceptance_length']):>7} "
            f"{fmt(last_val.get('val_sampled_tau_hat')):>11} {fmt(sampled.get('acceptance_length')):>8} "
            f"{fmt(sampled.get('prompt_lookup_acceptance_length')):>9}")


def plot(runs, out, x="step"):
    """x: "step", or "minutes" of training (the records' elapsed_s: validations and in-run
    evaluations included, the final evaluation not; runs from before elapsed_s was recorded are
    left out of a minutes plot)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    at = (lambda r: r["step"]) if x == "step" else (lambda r: r["elapsed_s"] / 60)  # noqa: E731
    series = []  # per run: its records on this x axis, its training records, its measured acceptance points
    for name, recs, final in runs:
        if x != "step":
            recs = [r for r in recs if "elapsed_s" in r]
        train = [r for r in recs if "loss" in r]
        measured = [(at(r), r["eval_acceptance_length"]) for r in recs if "eval_acceptance_length" in r]
        if final is not None and train:
            measured.append((at(train[-1]), final["acceptance_length"]))
        series.append((name, recs, train, measured, final))
    measured_any = any(measured or final is not None for *_, measured, final in series)
    fig, ax = plt.subplots(1, 3 if measured_any else 2, figsize=(16 if measured_any else 11, 4.5))  # no empty panel
    for n, (name, recs, train, measured, final) in enumerate(series):
        colour = f"C{n}"
        vals = [r for r in recs if "val_tau_hat" in r]
        ax[0].plot([at(r) for r in vals], [r["val_tau_hat"] for r in vals], "-", color=colour, label=name)
        replayed = [r for r in vals if "val_acceptance_length" in r]
        ax[0].plot([at(r) for r in replayed], [r["val_acceptance_length"] for r in replayed], ":", color=colour)
        sampled = [r for r in vals if "val_sampled_tau_hat" in r]
        ax[0].plot([at(r) for r in sampled], [r["val_sampled_tau_hat"] for r in sampled], "--", color=colour)
        ax[1].plot([at(r) for r in train], [r["lr"] for r in train], color=colour, label=name)
        if measured:
            ax[2].plot(*zip(*measured), "o-", color=colour, label=name)
        if final is not None:
            ax[2].axhline(final["prompt_lookup_acceptance_length"], color=colour, ls="--", lw=0.8)
    xlabel = "step" if x == "step" else "minutes of training"
    ax[0].set(title="held-out tau_hat (solid), decoding replayed (dotted),\nsampled tau_hat at --eval-temperature "
              "(dashed)", xlabel=xlabel)
    ax[1].set(title="learning rate", xlabel=xlabel)
    if measured_any:
        ax[2].set(title="measured acceptance length (dashed: prompt lookup)", xlabel=xlabel)
    for a in ax:
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run directories (--output-dir of train_dflash_pipeline.py)")
    p.add_argument("--out", default=None, help="PNG to write (default: no plot)")
    p.add_argument("--x", choices=("step", "minutes"), default="step",
                   help="the plot's x axis: optimizer steps, or minutes of training (comparable across settings "
                        "whose steps differ in cost)")
    a = p.parse_args(argv)
    runs = []
    for d in a.runs:
        if not os.path.exists(os.path.join(d, "metrics.jsonl")):
            sys.exit(f"{d}: no metrics.jsonl (not a run directory?)")
        runs.append((os.path.basename(os.path.normpath(d)), *plots.run_records(d)))
    print(f"{'run':<24} {'steps':>6} {'val tau':>8} {'replayed':>9} {'first':>9} {'measured@step':>14} "
          f"{'final':>6} {'lookup':>7} {'sampled tau':>11} {'final T':>8} {'lookup T':>9}")
    for name, recs, final in runs:
        print(summary(name, recs, final))
    if a.out:
        try:
            plot(runs, a.out, a.x)
            print(f"plot: {a.out}")
        except ImportError:
            print("plot: matplotlib is not installed; none written")


if __name__ == "__main__":
    main()
