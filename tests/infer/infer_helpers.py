"""Helpers shared by the inference tests (imported by name: tests/infer is on sys.path under pytest)."""

from types import SimpleNamespace

import torch

from longspec.drafter import Drafter, DrafterConfig
from longspec.infer.candidates import AUTO_LOOKUPS, AUTO_TREES
from longspec.kernels.row_argmax import row_argmax
from longspec.modules.layer_ops import write_kv

WINDOW = 8  # drafter window, far below the prompt lengths the tests use
# The round shapes (stats names) that leave the drafter's ring behind: plain steps and lookup chains
RING_BEHIND = {"ar"} | {c.name for c in AUTO_LOOKUPS}


def reference_greedy(target, prompt: torch.Tensor, num_tokens: int) -> list[int]:
    """Target-only greedy decoding with full forwards of the HF model (no cache): obviously right."""
    ids = prompt[None]
    for _ in range(num_tokens):
        next_id = target.model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_id.reshape(1, 1)], dim=1)
    return ids[0, prompt.numel() :].tolist()


def prefill_drafter(engine, prompts: list[torch.Tensor]) -> None:
    """The engine's token history and the drafter's ring buffer from `prompts`, one row each."""
    engine.history.prefill(prompts)
    engine.draft_step.prefill(prompts)


def random_drafter(target, window: int = WINDOW) -> Drafter:
    config = DrafterConfig.from_target_config(target.config, window=window)
    # Frozen, as Drafter.from_pretrained returns one: the engine then packs its projections (what runs).
    return Drafter(config, target.embed_tokens, target.lm_head).requires_grad_(False)


class OracleDrafter:
    """Stub drafter that proposes sequence b's reference continuation (litgpt-style forcing; one sequence per
    batch row): the "hidden state" of a query is its
    (row, position), and the logits at position p favour (or ban) sequences[row][p + 1], per `favour(p + 1)`.
    The ring buffer is the real one (`Drafter.fill_cache`); a draft level's hidden state is `hidden(ids,
    positions)`, which subclasses replace."""

    def __init__(self, config: DrafterConfig, sequences: list[list[int]], favour):
        self.config, self.sequences, self.favour = config, sequences, favour

    # The whole vocabulary: draft ids are target ids (a subclass with a draft vocabulary sets both).
    draft_vocab = None
    _draft_ids = None
    fill_cache = Drafter.fill_cache
    draft_vocab_size = Drafter.draft_vocab_size
    draft_ids = Drafter.draft_ids
    target_probs = Drafter.target_probs

    def self_kv(self, input_ids, position_ids, *, cache=None):
        shape = (input_ids.shape[0], self.config.num_kv_heads, input_ids.shape[1], self.config.head_dim)
        k, v = torch.zeros(shape), torch.zeros(shape)
        if cache is not None:
            write_kv(*cache, k, v, skip_negative=True)
        return k, v

    def draft_nodes(self, cache, positions, root=None, ancestors=None):
        if root is not None:
            positions = (root[:, None] if isinstance(root, torch.Tensor) else root) + positions
        return SimpleNamespace(positions=positions.expand(cache.keys.shape[0], -1))

    def tree_level(self, input_ids, nodes, level, *args):
        return self.hidden(input_ids, nodes.positions[:, level])

    def hidden(self, input_ids, positions):
        rows = torch.arange(positions.shape[0])[:, None].expand_as(positions)
        return torch.stack([rows, positions], dim=-1).float()  # [B, P, 2]

    def logits(self, hidden):
        out = torch.zeros(*hidden.shape[:-1], self.config.vocab_size)  # [B, P, V]
        for index in torch.cartesian_prod(*(torch.arange(d) for d in hidden.shape[:-1])).tolist():
            row, pos = (int(x) for x in hidden[tuple(index)].tolist())
            if row >= len(self.sequences):  # a batch bucket's padding row (frozen): any proposal
                continue
            token = self.sequences[row][pos + 1]
            out[tuple(index) + (token,)] = 10.0 if self.favour(pos + 1) else float("-inf")
        return out

    def pick(self, hidden):
        """As `Drafter.pick`: the target id of the largest logit (a greedy chain's level)."""
        return row_argmax(self.logits(hidden), self._draft_ids)


class CyclingCosts:
    """Stub cost model that makes a different tree="auto" candidate the cheapest at every cache length (the
    drafter's trees, "no speculation" and the lookup chains), so consecutive rounds run different round shapes
    (what the lossless tests need): a plain or lookup round's tokens must still reach the drafter's ring."""

    candidates = AUTO_TREES + AUTO_LOOKUPS

    def cost(self, widths, context_len):
        return 1.0 if self.candidates.index(widths) == context_len % len(self.candidates) else 1000.0
