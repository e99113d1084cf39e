import os

import torch

# Triton decides interpreter vs compiled when a kernel is *defined* (first import of a kernel module), so the
# CPU interpreter must be requested before any test here imports one. longspec imports kernel modules lazily.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
