"""The torch backend's engines against plain torch implementations of the same math (quantstudy.torch_vs_plain).

    python benchmarks/torch_vs_plain.py [--tiny | --config RUN.yaml [LAYER.yaml ...]] [--families fnet deberta_v2]
        [--settings 'fnet-base/*' 'xcit-*/b1'] [--profile] [--budget-s 450] [--compile-workers]
        [--out torch_vs_plain.json] [--workdir CHECKOUT] [--cores N]
    python benchmarks/torch_vs_plain.py --summary A.json B.json   # several calls' outputs together

--tiny: config/config.yaml's tiny models on the CPU torch target; default: config/h200.yaml (real
size, random weights, the H200 torch target); on another card, its layer after it (--config
config/h200.yaml config/realsize/calls/h100.yaml), since a target's jobs run only on the card it
declares. The workflow first makes the settings' baseline and
candidate builds in --workdir (default: this checkout). On an offline H200 node (./.whl as for
results/h200-torch/run.sh), from the repository root:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 python3 benchmarks/torch_vs_plain.py --profile \
        --budget-s 450 --out $OUT/torch_vs_plain.json > $OUT/torch_vs_plain.md

Exit status 1 where a setting failed or its outputs differ.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from quantstudy.torch_vs_plain import cli  # noqa: E402

if __name__ == "__main__":
    cli()
