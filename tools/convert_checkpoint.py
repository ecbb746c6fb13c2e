#!/usr/bin/env python
"""Convert checkpoints between Hugging Face and megatron-core (dist_checkpointing, torch_dist).

    python tools/convert_checkpoint.py hf-to-mcore --hf-dir HF --out-dir MCORE [--tp 1 --ep 1]
    python tools/convert_checkpoint.py mcore-to-hf --mcore-dir MCORE --out-dir HF [--tp 2 ...]
    torchrun --nproc_per_node=2 tools/convert_checkpoint.py mcore-to-hf ... --ep 2

The layout of the saving and the loading run may differ. ``--overwrite`` replaces an existing
output. Same as ``megatron-sat convert``; see megatron_sat/checkpoint/convert.py.
"""

import sys

from megatron_sat.checkpoint.convert import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
