"""Render README's picture, `docs/images/depth_map.png`: a demo run's token-averaged depth attention at its final
checkpoint, every consumer (pre-attention, pre-MLP, final readout) against every source in one heatmap.

It reads the run's recorded `records/depth_weights.parquet` (docs/run_directory.md §5) and draws it with the
dashboard's own figure code and PNG export (kaleido with the local Chromium), so the picture is what the Depth
attention page shows. From the repository root:

    python apps/render_depth_map.py [--run data/demo_runs/depth-block-6l] [--out docs/images/depth_map.png]
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

APP_DIR = Path(__file__).resolve().parent
REPO_ROOT = APP_DIR.parent
if str(APP_DIR) not in sys.path:  # lens_ui is the dashboard's package, importable from apps/
    sys.path.insert(0, str(APP_DIR))

import pandas as pd
from lens_ui.figures import depth_matrix, heatmap
from lens_ui.widgets import figure_png, png_browser
from PIL import Image

from attnres_lens.rundir import RunDir, checkpoint_step

WIDTH = 640  # pixels before kaleido's 2× scale: README shows it about this wide


def render(run: Path, out: Path) -> None:
    run_dir = RunDir(run)
    records = run_dir.record_path("depth_weights")
    if not records.is_file():
        raise SystemExit(
            f"{records} does not exist: --run must be an AttnRes run directory with recorded depth "
            "weights, e.g. data/demo_runs/depth-block-6l"
        )
    weights = pd.read_parquet(records)
    step = checkpoint_step(run_dir.resolve_checkpoint("latest"))
    snapshot = weights[weights["step"] == step]
    if snapshot.empty:
        raise SystemExit(
            f"{run} recorded no depth weights at its final checkpoint (step {step}); "
            f"recorded steps: {sorted(weights['step'].unique())}"
        )
    # One matrix over every consumer, in forward order: the pre-attention, pre-MLP and final-readout panels of the
    # Depth attention page stacked into one.
    matrix = depth_matrix(snapshot.assign(kind="all"), "all")
    fig = heatmap(
        matrix,
        f"Depth attention of {run.name} at step {step}<br><sup>token-averaged α: each row (a "
        "consumer) reads a softmax mix over its sources</sup>",
        "α (token mean)",
        0.0,
        1.0,
        x_title="source",
        y_title="consumer",
        hover="α",
    )
    fig.update_layout(width=WIDTH)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Pillow's lossless re-encoding keeps the repository's copy small (about a fifth less than kaleido's PNG).
    image = Image.open(io.BytesIO(figure_png(fig)))
    image.save(out, format="PNG", optimize=True)
    print(f"{out}: {out.stat().st_size / 1024:.0f} KB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, default=REPO_ROOT / "data" / "demo_runs" / "depth-block-6l")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "images" / "depth_map.png")
    args = parser.parse_args()
    if png_browser() is None:
        raise SystemExit("PNG export needs kaleido and Chromium or Chrome (make setup installs both)")
    render(args.run, args.out)


if __name__ == "__main__":
    main()
