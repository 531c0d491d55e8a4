"""The quality table of a precision sweep: per run, SSIM against the BF16 output, the BF16 rerun, % of the rerun,
PSNR against the correct edit and the share of edits right (docs/METRICS.md), beside the published MI355X
study's figures.

    ditrun -m precision=bf16,fp8,fp8_all,mxfp8,mxfp6,mxfp4,krea hydra.sweep.dir=SWEEP
    python benchmarks/quality_table.py SWEEP [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

# The published study (FLUX.1-Kontext-dev on MI355X): % of the BF16 rerun's SSIM (rerun SSIM 0.962).
STUDY_PCT_OF_RERUN = {"fp8": 99.2, "mxfp6": 98.3, "mxfp4": 89.2}


def _median(records: list[dict], key: str):
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def rows(sweep: Path) -> list[dict]:
    out = []
    for summary_file in sorted(sweep.glob("*/summary.json"), key=lambda p: int(p.parent.name)):
        summary = json.loads(summary_file.read_text())
        records = [json.loads(line) for line in (summary_file.parent / "edits.jsonl").read_text().splitlines() if line]
        name = summary["config"]["precision"]["name"]
        target, target_bf16 = summary.get("psnr_target_median"), summary.get("psnr_target_bf16_median")
        out.append(
            {
                "precision": name,
                "ran": records[0]["precision"],
                "dit_s_median": summary.get("dit_s_median"),
                "ssim": _median(records, "ssim"),
                "ssim_rerun": _median(records, "ssim_rerun"),
                "ssim_pct_of_rerun": _median(records, "ssim_pct_of_rerun"),
                "psnr_target": target,
                "psnr_target_bf16": target_bf16,
                "edits_right_share": summary.get("edits_right_share"),
                "target_pct_of_bf16": 100 * target / target_bf16 if target and target_bf16 else None,
                "study_pct_of_rerun": STUDY_PCT_OF_RERUN.get(name),
                "device": summary.get("device"),
            }
        )
    return out


def markdown(table: list[dict]) -> str:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    share = lambda v: "-" if v is None else f"{100 * v:.0f}%"  # noqa: E731
    lines = [
        "| precision | SSIM vs BF16 | BF16 rerun | % of rerun | PSNR vs correct edit, dB "
        "| % of BF16's | edits right | study's % of rerun |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in table:
        lines.append(
            f"| {r['precision']} | {fmt(r['ssim'], '.4f')} | {fmt(r['ssim_rerun'], '.4f')} | "
            f"{fmt(r['ssim_pct_of_rerun'], '.2f')} | {fmt(r['psnr_target'], '.2f')} | "
            f"{fmt(r['target_pct_of_bf16'], '.1f')} | {share(r['edits_right_share'])} | "
            f"{fmt(r['study_pct_of_rerun'], '.1f')} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    table = rows(args.sweep)
    print(markdown(table))
    if table:
        print(f"device: {table[0]['device']}")
    if args.json:
        args.json.write_text(json.dumps(table, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
