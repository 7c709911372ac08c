"""Markdown tables from `rsd bench --json` files: python benchmarks/summarise.py FILE..."""

import json
import sys


def fmt(value, digits=2):
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


for path in sys.argv[1:]:
    report = json.load(open(path))
    print(f"\n`{path}`\n")
    print("| variant | setting | shape | T | BE | accept | MBSU | tok/s | × ar | draft s | verify s | overhead s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in report["results"]:
        setting = f"budget {r['budget']}" if r["budget"] else f"depth {r['depth']}" if r["depth"] else "-"
        print(f"| {r['variant']} | {setting} | {r['shape']} | {r['temperature']:g} | {fmt(r['block_efficiency'])} | "
              f"{fmt(r['acceptance_rate'])} | {fmt(r['mbsu'])} | {fmt(r['tokens_per_second'], 1)} | "
              f"{fmt(r['speedup_vs_ar'])} | {fmt(r['draft_seconds'], 1)} | {fmt(r['verify_seconds'], 1)} | "
              f"{fmt(r['overhead_seconds'], 1)} |")
    memory = report.get("memory")
    if memory:
        print(f"\npeak RSS {memory['peak_rss_mb']:.0f} MB, weights {memory['weights_mb']:.0f} MB "
              f"({memory['peak_over_weights']:.2f}×)")
