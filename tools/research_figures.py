"""The research notebook's plots of the shipped demo model, saved as PNGs for docs/demo_model.md.

    python tools/research_figures.py             # CPU, under a minute: docs/research_*.png
    python tools/research_figures.py --out /tmp/figs

The committed notebooks carry no outputs (`tests/test_notebooks.py`), so their plots are not visible
on a repository page. This script runs the code cells of `notebooks/research.ipynb` itself, in
order and unchanged (the analyses are `flint_jax.research`: `expert_usage`, `logit_lens`,
`token_rank_prob`, `sink_mass`), on the demo model, on the CPU, and saves the figure that a
section's cell shows (the notebook's `show(fig)`) to a file:

* `research_expert_usage.png`: share of each expert's top-k selections per MoE layer, held-out
  Python against held-out chats without tools ("Expert usage: code against prose chat");
* `research_logit_lens.png`: the logit lens across layers ("Logit lens");
* `research_sink_mass.png`: the sinks' share of attention ("Attention-sink mass").

Other sections' figures (router entropy) are not saved. The notebook's printed numbers go to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "research.ipynb")
# Markdown heading of a notebook section -> the file its figure goes to.
FIGURES = {"## Expert usage": "research_expert_usage.png",
           "## Logit lens": "research_logit_lens.png",
           "## Attention-sink mass": "research_sink_mass.png"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "docs"), help="directory for the PNGs")
    p.add_argument("--dpi", type=int, default=80)
    a = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["MPLBACKEND"] = "Agg"
    sys.path.insert(0, ROOT)
    import matplotlib.pyplot as plt

    with open(NOTEBOOK, encoding="utf-8") as f:
        cells = json.load(f)["cells"]
    target = {"path": None}
    written = []

    def save(fig):   # replaces the notebook's show(fig)
        if target["path"]:
            fig.savefig(target["path"], format="png", dpi=a.dpi, bbox_inches="tight")
            written.append(target["path"])
            print(f"[research_figures] wrote {target['path']} "
                  f"({os.path.getsize(target['path']) / 1024:.0f} KiB)", flush=True)
            target["path"] = None
        plt.close(fig)

    os.makedirs(a.out, exist_ok=True)
    ns: dict = {"__name__": "__research_notebook__"}
    for cell in cells:
        src = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            target["path"] = next((os.path.join(a.out, name) for head, name in FIGURES.items()
                                   if src.startswith(head)), None)
            continue
        exec(compile(src, NOTEBOOK, "exec"), ns)
        ns["show"] = save   # defined by the first code cell; every figure goes through it
    missing = set(os.path.join(a.out, n) for n in FIGURES.values()) - set(written)
    if missing:
        raise SystemExit(f"no figure for {sorted(missing)}: did the notebook's sections change?")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
