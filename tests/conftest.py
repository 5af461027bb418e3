import os
import sys
from pathlib import Path

import torch

# No network, no hub, no accidental online wandb runs during tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The models and batches in these tests are tiny: intra-op threads gain nothing and, on a shared 2-core machine,
# spin against other processes (a 4-step TRL run took 10x longer with 2 threads under load).
torch.set_num_threads(1)

# Shared test helpers (tests/file_modules.py, tests/bitwise.py) importable from every test folder.
sys.path.insert(0, str(Path(__file__).resolve().parent))
