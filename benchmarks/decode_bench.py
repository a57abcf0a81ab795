"""The decode benchmark from a source checkout: the same as `flint-jax bench` (its code is
``flint_jax.bench``, so the command also works from an installed wheel).

    python benchmarks/decode_bench.py --dtype nvfp4 --batch 1 --context 1024 --option early_trigger=false
"""

import sys

from flint_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
