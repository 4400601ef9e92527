"""One markdown row per profiled kernel launch from Nsight Compute's CSV (--section SpeedOfLight --csv): its grid,
duration and the Speed-of-Light throughputs (percent of the device's peak), and ncu's bottleneck note.

    python3 tools/gpu/ncu_summary.py ncu_attention.csv > ncu_attention.md
"""

import csv
import io
import sys

METRICS = ["Duration", "Compute (SM) Throughput", "Memory Throughput", "DRAM Throughput", "L1/TEX Cache Throughput",
           "L2 Cache Throughput"]


def main():
    with open(sys.argv[1]) as f:
        rows = [line for line in f.read().splitlines() if line.startswith('"')]
    table = list(csv.reader(io.StringIO("\n".join(rows))))
    if not table:
        print("no kernel was profiled")
        return
    head = {name: i for i, name in enumerate(table[0])}
    launches = {}
    for r in table[1:]:
        launch = launches.setdefault(r[head["ID"]], {"kernel": r[head["Kernel Name"]].split("(")[0],
                                                     "grid": r[head["Grid Size"]], "block": r[head["Block Size"]],
                                                     "note": ""})
        if r[head["Metric Name"]] in METRICS:
            launch[r[head["Metric Name"]]] = f"{r[head['Metric Value']]} {r[head['Metric Unit']]}".strip()
        if r[head["Rule Name"]] == "SOLBottleneck":
            launch["note"] = r[head["Rule Description"]].split(".")[0]
    print("| launch | kernel | grid x block | " + " | ".join(METRICS) + " | bottleneck |")
    print("|---|---|---|" + "---:|" * len(METRICS) + "---|")
    for i, l in launches.items():
        cells = " | ".join(l.get(m, "-") for m in METRICS)
        print(f"| {i} | {l['kernel']} | {l['grid']} x {l['block']} | {cells} | {l['note']} |")


if __name__ == "__main__":
    main()
