import os

# No network, no hub, no accidental online wandb runs during tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import sys
from pathlib import Path

# Shared test helpers (tests/file_modules.py) importable from every test folder.
sys.path.insert(0, str(Path(__file__).resolve().parent))
