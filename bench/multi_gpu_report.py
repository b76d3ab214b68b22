"""The logs of bench/multi_gpu.sh, stamped while it runs and read back into one table.

    ... | python bench/multi_gpu_report.py stamp > train.log    # seconds since start before each line
    python bench/multi_gpu_report.py report OUT_DIR              # OUT_DIR/table.md + summary.json

An arm folder (OUT_DIR/ARM) holds train.log, gpu_mem.csv (`index, MiB` samples of
nvidia-smi), rc, and, from the run folder, metrics.jsonl and run_config.json. The steady
step is the median of the intervals between consecutive `[OPSD kl] step=N` lines for
N >= STEADY_FROM: the first steps compile (the decode loop per prompt-width bucket, the
decoder layers), later ones should not, which the recompilation count checks.
"""
from __future__ import annotations

import json
import re
import statistics
import sys
import time
from pathlib import Path

STEP_LINE = re.compile(r"^\s*(\d+\.\d+) .*\[OPSD kl\] step=(\d+)")
RECOMPILE = "Recompiling function"  # one line per recompilation with TORCH_LOGS=recompiles (every rank)
STEADY_FROM = 4
ARM_ORDER = ("single", "ddp", "fsdp2", "zero2", "zero3")


def stamp(lines, out) -> None:
    start = time.monotonic()
    for line in lines:
        out.write(f"{time.monotonic() - start:9.2f} {line}")
        out.flush()


def read_arm(folder: Path) -> dict:
    # bytes, not read_text(): universal newlines would turn tqdm's carriage returns into line ends
    log = (folder / "train.log").read_bytes().decode(errors="replace") if (folder / "train.log").is_file() else ""
    stamps: dict[int, float] = {}
    for line in log.split("\n"):  # not splitlines(), which also ends lines at carriage returns
        match = STEP_LINE.search(line)
        if match:
            stamps.setdefault(int(match.group(2)), float(match.group(1)))
    steady = [stamps[n] - stamps[n - 1] for n in sorted(stamps) if n >= STEADY_FROM and n - 1 in stamps]
    peak: dict[str, float] = {}
    mem = folder / "gpu_mem.csv"
    for row in mem.read_text().splitlines() if mem.is_file() else []:
        parts = [p.strip() for p in row.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            peak[parts[0]] = max(peak.get(parts[0], 0.0), int(parts[1]) / 1024)
    metrics = []
    if (folder / "metrics.jsonl").is_file():
        metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    config = json.loads((folder / "run_config.json").read_text()) if (folder / "run_config.json").is_file() else {}
    rc = (folder / "rc").read_text().strip() if (folder / "rc").is_file() else "?"
    return {
        "arm": folder.name,
        "rc": rc,
        "layout": (f"{config['num_processes']} x {config['per_device_train_batch_size']} x "
                   f"{config['gradient_accumulation_steps']}") if config else "?",
        "steps_logged": len(stamps),
        "first_step_s": stamps.get(1),
        "steady_steps_s": steady,
        "steady_step_s": statistics.median(steady) if steady else None,
        "peak_gib_per_gpu": dict(sorted(peak.items())),
        "recompiles": log.count(RECOMPILE),
        "loss": {r["step"]: r.get("loss") for r in metrics if "step" in r},
        "true_kl": {r["step"]: r.get("opsd/true_kl") for r in metrics if "step" in r},
    }


def _num(value, fmt="{:.2f}") -> str:
    return "n/a" if value is None else fmt.format(value)


def report(out_dir: Path) -> str:
    arms = [read_arm(folder) for folder in sorted(
        (f for f in out_dir.iterdir() if f.is_dir() and (f / "train.log").is_file()),
        key=lambda f: (ARM_ORDER.index(f.name) if f.name in ARM_ORDER else len(ARM_ORDER), f.name))]
    lines = [
        f"## Capped step: {', '.join(a['arm'] for a in arms) or 'no arm yet'}", "",
        f"Steady step: median of the intervals between the logs of steps {STEADY_FROM}..N (n of them). Peak "
        "memory: nvidia-smi's largest sample per GPU (allocator cache and CUDA context included). "
        "Recompilations: TORCH_LOGS=recompiles lines, all ranks.", "",
        "| arm | GPUs x micro-batch x accumulation | exit | steps | start to step 1 (s) | steady step (s) "
        "| peak GiB per GPU | recompilations | last loss | last true KL |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a in arms:
        last = max(a["loss"], default=None)
        memory = ", ".join(f"{gpu}: {gib:.1f}" for gpu, gib in a["peak_gib_per_gpu"].items()) or "n/a"
        lines.append(
            f"| {a['arm']} | {a['layout']} | {a['rc']} | {a['steps_logged']} | {_num(a['first_step_s'], '{:.1f}')} "
            f"| {_num(a['steady_step_s'])} (n={len(a['steady_steps_s'])}) | {memory} | {a['recompiles']} "
            f"| {_num(a['loss'].get(last), '{:.4g}')} | {_num(a['true_kl'].get(last), '{:.4g}')} |")
    steps = sorted({step for a in arms for step in a["loss"]})
    if steps:
        lines += ["", "Loss and true KL per step:", "",
                  "| step | " + " | ".join(f"{a['arm']} loss" for a in arms) + " | "
                  + " | ".join(f"{a['arm']} true KL" for a in arms) + " |",
                  "|---|" + "---|" * (2 * len(arms))]
        for step in steps:
            cells = [_num(a["loss"].get(step), "{:.4g}") for a in arms]
            cells += [_num(a["true_kl"].get(step), "{:.4g}") for a in arms]
            lines.append(f"| {step} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    (out_dir / "table.md").write_text(table)
    (out_dir / "summary.json").write_text(json.dumps(arms, indent=1))
    return table


def main(argv: list[str]) -> int:
    if argv[:1] == ["stamp"] and len(argv) == 1:
        stamp(sys.stdin, sys.stdout)
        return 0
    if argv[:1] == ["report"] and len(argv) == 2 and Path(argv[1]).is_dir():
        print(report(Path(argv[1])))
        return 0
    print("error: usage: multi_gpu_report.py stamp | report OUT_DIR (an existing folder)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
