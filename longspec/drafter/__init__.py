"""The LongSpec drafter (docs/ALGORITHM.md §2): one decoder block over the target's embeddings, KV and LM head.

- `model.py`: the block (`Drafter`): training forward, the inference step (`tree_level`), save / load;
- `config.py`: its shapes, copied from the target (`DrafterConfig`);
- `cache.py`: its inference-time self-attention K/V (`DrafterCache` ring buffer, `DraftNodes`);
- `weights.py`: weights that are numbers (a NaN / inf tensor is refused at load, export and checkpoint).
"""

from longspec.drafter.cache import DrafterCache, DraftNodes
from longspec.drafter.config import DEFAULT_WINDOW, DrafterConfig
from longspec.drafter.model import CONFIG_NAME, WEIGHTS_NAME, Drafter

__all__ = [
    "DEFAULT_WINDOW",
    "DrafterConfig",
    "Drafter",
    "DrafterCache",
    "DraftNodes",
    "WEIGHTS_NAME",
    "CONFIG_NAME",
]
