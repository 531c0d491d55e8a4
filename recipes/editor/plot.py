"""The training curves of a ``losses.jsonl`` (``python -m recipes.editor.train``'s log) as one picture:

    python -m recipes.editor.plot LOSSES.jsonl OUT.png

Left, the VAE: its loss and the held-out round trip's median PSNR; right, the DiT: its flow-matching loss and the
held-out edits' median PSNR against the correct edit; a phase the log holds no step of (a DiT-only training) is
left out. Rows written by several resumed commands join into one curve
(each step is logged once: a command resumes at the step its predecessor's checkpoint holds)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PANELS = (
    ("vae", "vae/loss", "vae/eval_psnr", "held-out round trip, median PSNR (dB)"),
    ("dit", "dit/loss", "dit/eval_psnr", "held-out edits, median PSNR against the correct edit (dB)"),
)


def curves(rows: list[dict], phase: str, key: str) -> tuple[list[int], list[float]]:
    points = sorted({r["step"]: r[key] for r in rows if r.get("phase") == phase and key in r}.items())
    return [p[0] for p in points], [p[1] for p in points]


def draw(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [panel for panel in PANELS if curves(rows, panel[0], panel[1])[0]] or list(PANELS)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.6), squeeze=False)
    for ax, (phase, loss, psnr, label) in zip(axes[0], panels):
        steps, values = curves(rows, phase, loss)
        ax.plot(steps, values, color="tab:blue", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_xlabel(f"{phase.upper()} step")
        ax.set_ylabel(f"{loss} (log)", color="tab:blue")
        right = ax.twinx()
        steps, values = curves(rows, phase, psnr)
        right.plot(steps, values, "o-", color="tab:red")
        right.ticklabel_format(axis="y", useOffset=False)  # dB as read, not as an offset from a base
        right.set_ylabel(label, color="tab:red", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("losses", type=Path)
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    if not args.losses.is_file():
        print(f"plot: {args.losses} is not a file (a losses.jsonl written by recipes.editor.train).", file=sys.stderr)
        return 2
    rows = [json.loads(line) for line in args.losses.read_text().splitlines() if line.strip()]
    draw(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
