#!/usr/bin/env python3
"""Print what ``sitecustomize.py`` (beside this file) recorded: ``report.py DIR [--top N] [--timeline]``."""

import argparse
import json
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("dir")
ap.add_argument("--top", type=int, default=15)
ap.add_argument("--timeline", action="store_true")
a = ap.parse_args()
docs = [json.loads(p.read_text()) for p in sorted(Path(a.dir).glob("*.json"))]
t0 = min(d["t0"] for d in docs)
for d in docs:
    print(f"=== pid {d['pid']} {' '.join(d['argv'])[:100]} (started +{d['t0'] - t0:.2f} s)")
    for tn, th in sorted(d["threads"].items(), key=lambda x: -x[1]["seconds"]):
        if th["seconds"] < 0.2:
            continue
        print(f"  -- thread {tn}: {th['seconds']:.2f} s")
        for k, c in th["self"][: a.top]:
            print(f"     self {c / d['hz']:6.2f}  {k}")
        for k, c in th["incl"][: a.top]:
            print(f"     incl {c / d['hz']:6.2f}  {k}")
        for k, c in th.get("site", [])[: a.top]:
            print(f"     site {c / d['hz']:6.2f}  {k}")
        if a.timeline:
            prev = None
            for t, top in th["timeline"]:
                k = top[0][0]
                if k != prev:
                    print(f"     t={t + d['t0'] - t0:7.2f}  {k}")
                    prev = k
