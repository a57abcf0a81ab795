"""Execute every notebook under notebooks/ (on the demo model, CPU) and fail on any cell error.

The notebooks run in a temporary copy, on a demo checkpoint written to a temporary
`FLINT_JAX_DEMO_DIR`, with `JAX_PLATFORMS=cpu` and `MPLBACKEND=Agg`. Their kernel is the running
interpreter: a `python3` kernelspec pointing at `sys.executable` is written to a temporary
`JUPYTER_PATH` (which takes precedence over any user or system kernelspec), and `PYTHONPATH`
starts with the repository root so the kernel imports this working tree's `flint_jax` whether or
not it is pip-installed.
The committed notebooks carry no outputs; `test_notebooks_have_no_outputs` keeps it that way.
"""

import json
import os
import pathlib
import shutil
import sys
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """Environment for the kernels: own kernelspec, demo checkpoint dir, CPU, working tree."""
    base = tmp_path_factory.mktemp("nbkernel")
    spec_dir = base / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (flint_jax tests)", "language": "python"}))
    # A demo checkpoint of their own (per pytest-xdist worker: no two writers share a directory).
    demo = str(tmp_path_factory.getbasetemp() / "flint_demo")
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {"JUPYTER_PATH": str(base / "jupyter"), "FLINT_JAX_DEMO_DIR": demo,
            "JAX_PLATFORMS": "cpu", "PYTHONPATH": pythonpath, "MPLBACKEND": "Agg",
            "PYDEVD_DISABLE_FILE_VALIDATION": "1"}


def test_notebooks_exist():
    names = {p.name for p in NOTEBOOKS}
    assert {"quickstart.ipynb", "research.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebooks_have_no_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
             and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, f"{path.name}: clear the outputs of cells {dirty} before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, kernel_env, tmp_path, monkeypatch):
    for k, v in kernel_env.items():
        monkeypatch.setenv(k, v)
    work = tmp_path / path.name
    shutil.copy(path, work)
    nb = nbformat.read(work, as_version=4)
    # A first cell (in this run only) reports which interpreter and flint_jax the kernel uses.
    nb.cells.insert(0, nbformat.v4.new_code_cell(
        "import sys, flint_jax; print(sys.executable); print(flint_jax.__file__)"))
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                                     resources={"metadata": {"path": str(tmp_path)}})
    t0 = time.time()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name}: a cell failed:\n{e}")
    finally:
        nbformat.write(nb, work)  # executed copy, for a look after a failure
    elapsed = time.time() - t0
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, errors
    exe, pkg = nb.cells[0].outputs[0]["text"].split()
    assert os.path.realpath(exe) == os.path.realpath(sys.executable)
    assert pathlib.Path(pkg).resolve().parent == ROOT / "flint_jax"
    print(f"{path.name}: executed in {elapsed:.1f} s")
