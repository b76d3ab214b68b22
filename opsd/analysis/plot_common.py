"""What every figure of opsd.analysis.plots shares: the one-line PlotError, the output check,
the figure grid, the PNG writer (a temporary file renamed into place, so a failure leaves no
partial PNG), step axes, run and seed names, JSON reading, and `draw_or_warn` for the end of a
run or a grid. matplotlib is imported inside the functions that draw, never at import.
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

DPI = 100


class PlotError(Exception):
    """Bad input for a plot; the message is one line (printed as `error: ...`, exit 2)."""


def run_name(run_dir) -> str:
    """A run folder as a reader names it: a grid cell (GRID/ARM/seed-N/run) by its grid, arm and
    seed, any other run by its folder's name."""
    parts = Path(run_dir).resolve().parts
    if len(parts) >= 4 and parts[-1] == "run" and seed_number(Path(parts[-2])) >= 0:
        return f"{parts[-4]}: arm {parts[-3]}, seed {seed_number(Path(parts[-2]))}"
    return parts[-1] if parts else str(run_dir)


def step_axis(ax) -> None:
    """Steps are whole numbers: ticks only there (matplotlib would put one at 4.5)."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("step", fontsize=9)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def seed_number(folder: Path) -> int:
    tail = folder.name.removeprefix("seed-")
    return int(tail) if tail.isdigit() else -1


def check_output(out) -> Path:
    """A .png path in an existing, writable folder: checked before any work is done."""
    path = Path(out)
    if path.suffix.lower() != ".png":
        raise PlotError(f"{out}: the output must be a .png file")
    folder = path.parent
    if not folder.is_dir():
        raise PlotError(f"{out}: no such folder {folder}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PlotError(f"{out}: folder {folder} is not writable")
    if path.is_dir():
        raise PlotError(f"{out}: is a folder")
    return path


def new_figure(panels: int, width: float = 4.4, height: float = 3.0, columns: int = 3):
    from matplotlib.figure import Figure  # here, not at the top: importing this module stays cheap

    columns = 2 if panels == 4 else min(columns, panels)  # 2 x 2 rather than 3 + 1
    rows = math.ceil(panels / columns)
    fig = Figure(figsize=(width * columns, height * rows + 0.4), dpi=DPI, layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax in axes[panels:]:
        ax.remove()
    return fig, list(axes[:panels])


def panel_heading(ax, title: str, note: str = "") -> None:
    """A panel's title, with `note` (one short line: what a healthy run looks like) in small grey
    type between it and the axes."""
    ax.set_title(title, fontsize=10, pad=14 if note else 6)
    if note:
        ax.text(0.5, 1.012, note, transform=ax.transAxes, ha="center", va="bottom", fontsize=7.5, color="0.35")


def save_png(fig, out: Path) -> None:
    """Render with the Agg canvas and write a 256-colour PNG into a temporary file, then
    rename: a failure leaves no partial PNG. The palette makes line plots about a third of
    the size of a full-colour PNG with no visible difference."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image  # a dependency of matplotlib

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    image = Image.fromarray(np.asarray(canvas.buffer_rgba())).convert("RGB").quantize(colors=256)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        image.save(tmp, format="PNG", optimize=True)
        os.replace(tmp, out)
    except OSError as exc:
        raise PlotError(f"{out}: cannot write it ({exc.strerror or exc})") from None
    finally:
        if tmp.exists():
            tmp.unlink()


def draw_or_warn(what: str, draw, *args, **kwargs):
    """For the end of a training run or a grid, whose work is done whatever happens here:
    `draw(*args, **kwargs)`, or None after one `warning:` line on stderr."""
    try:
        return draw(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - no matplotlib, a full disk, ...: the figure is optional
        print(f"warning: {what} not drawn: {' '.join(str(exc).split()) or type(exc).__name__}", file=sys.stderr)
        return None


def read_json(path, what: str):
    """The JSON in `path`; a missing or unreadable file is a PlotError naming it (`what`: what the
    file should be, for the message)."""
    file = Path(path)
    if not file.is_file():
        raise PlotError(f"{path}: no such file ({what})")
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise PlotError(f"{path}: not readable JSON ({exc})") from None
