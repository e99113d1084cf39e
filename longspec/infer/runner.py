"""One speculative round on the device, and its settling on the host: `RoundRunner`, used by the decode loop
(`loop.DecodeLoop`) and by the round-cost measurement (`policy.measure`) alike.

Shape legend: B sequences decoded together, N tree nodes, V vocabulary.

A round, from the roots [B] (the last tokens emitted, not yet in any cache):
  1. propose: a drafter tree (`DraftStep.draft_tree`), a prompt-lookup chain or forest (`pld.lookup_tree`) or the
             root alone (a plain step), by the round's shape (`candidates.RoundShape.propose`);
  2. verify:  ONE target forward over the N nodes (`TargetStep.tree_logits`);
  3. accept:  greedy or lossless sampling on the device with fixed shapes (`accept_round`);
  4. commit:  the accepted path's K/V move into place, its tokens enter the history and (a drafter tree's round)
              the drafter's ring; the committed lengths advance on the device (`commit`).
`launch` runs 1-4 without reading anything on the host (on static shapes as ONE static step, with cuda_graphs
one graph launch) and starts one asynchronous copy of the round's outputs to the host; `settle` waits for it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from longspec.infer.accept import (
    emitted_tokens,
    greedy_path,
    sample_chain_path,
    sample_path,
    sample_token,
    target_distribution,
    uniforms,
)
from longspec.infer.candidates import DrafterTree, Lookup, RoundShape
from longspec.infer.config import GenerationConfig
from longspec.infer.methods import DecodingMethod
from longspec.infer.pld import lookup_tree
from longspec.infer.slots import BatchSlots, compaction
from longspec.infer.timing import PhaseClock
from longspec.infer.tree import DraftTree, TreeLayout
from longspec.kernels.chain_accept import chain_packed, greedy_chain_packed
from longspec.kernels.path_commit import commit_path
from longspec.kernels.row_argmax import row_argmax

__all__ = ["HostCopies", "Round", "RoundRunner", "accept_round"]


@dataclass
class Round:
    """A launched round, until it settles: what the host needs to finish it."""

    candidate: RoundShape
    depth: int  # levels drafted (the packed output is [B, 2 (depth + 1) + 1])
    active: list[bool]  # the rows it commits for (the host's view at launch)
    packed: torch.Tensor  # emitted tokens, path, count per row: on the host once `copied` has completed
    copied: torch.cuda.Event | None  # the copy's event (None: already on the host)
    launched_at: float
    context_len: int  # the context length the policy chose it for
    index: int = 0  # the call's round number
    extra_s: float = 0.0  # host seconds spent for it before its launch (the ring's catch-up): charged to it
    switched: bool = False  # the ring caught up before it: its time includes the switch


class HostCopies:
    """The rounds' device-to-host copies, started without waiting: into pinned memory (an asynchronous copy needs
    it), each with an event to wait on. Buffers and events are kept per shape and reused once their round has
    settled, so a round allocates nothing (at most two rounds are in flight)."""

    def __init__(self):
        self.free: dict[tuple, list[tuple[torch.Tensor, torch.cuda.Event]]] = {}

    def start(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """(host tensor, event) for `packed`; a CPU tensor is copied now (no event): a static step's output is
        overwritten by its next call, as a GPU copy taken at launch is not."""
        if packed.device.type != "cuda":
            return packed.clone(), None
        free = self.free.setdefault((tuple(packed.shape), packed.dtype), [])
        if free:
            host, copied = free.pop()
        else:
            host, copied = torch.empty_like(packed, device="cpu").pin_memory(), torch.cuda.Event()
        host.copy_(packed, non_blocking=True)
        copied.record()
        return host, copied

    def read(self, host: torch.Tensor, copied: torch.cuda.Event | None) -> list:
        """Wait for the copy (the round's one host sync), read it, and give the buffer back."""
        if copied is None:
            return host.tolist()
        copied.synchronize()
        out = host.tolist()
        self.free[(tuple(host.shape), host.dtype)].append((host, copied))
        return out


class RoundRunner:
    """Launches, settles and catches up rounds on one engine's state: the target step (cache, verify forward,
    static steps), the drafter's step (ring buffer, draft tree; None without a drafter), the token history and
    the constant forest parts."""

    def __init__(self, target_step, draft_step, history, forests, device: torch.device):
        self.target_step, self.draft_step, self.history, self.forests = (
            target_step,
            draft_step,
            history,
            forests,
        )
        self.device = device
        self.host_copies = HostCopies()
        self._every_row_masks: dict[int, torch.Tensor] = {}  # `_every_row`

    @property
    def cache(self):
        """The target's static KV cache."""
        return self.target_step.cache

    # ------------------------------------------------------------------ the call's start
    def start(
        self, prompts: list[torch.Tensor], config: GenerationConfig, generator, *, history: bool, ring: bool
    ) -> torch.Tensor:
        """The call's prefill: every prompt into its cache row (`TargetStep.prefill`), then (`history`) the token
        history and (`ring`) the drafter's ring buffer from the prompts; returns the first generated token of
        each row [B] (on device)."""
        logits = self.target_step.prefill(prompts, config.prefill_chunk)  # [B, V]
        roots = self._pick(logits, config, generator)
        if history:
            self.history.prefill(prompts)
        if ring:
            self.draft_step.prefill(prompts)
        return roots

    def _pick(self, logits: torch.Tensor, config: GenerationConfig, generator) -> torch.Tensor:
        if config.temperature == 0:
            return row_argmax(logits)
        target_probs = target_distribution(
            logits, temperature=config.temperature, top_k=config.top_k, top_p=config.top_p
        )
        return sample_token(target_probs, generator)

    # ------------------------------------------------------------------ a round's pieces
    def draft(
        self,
        roots: torch.Tensor,
        layout: TreeLayout,
        *,
        static: bool = False,
        capture: bool = False,
        config: GenerationConfig | None = None,
        generator: torch.Generator | None = None,
    ) -> DraftTree:
        """The drafter's tree [B, N] from `roots` [B] at the committed lengths, eager or static / captured
        (`DraftStep.draft`). With a config whose `rrs` is set, children are sampled from the drafter's q shaped
        like the target's distribution (noise from `generator`) and the tree carries q as `draft_probs`."""
        shaping = None if config is None else _shaping(config)
        return self.draft_step.draft(
            roots,
            layout,
            self.target_step,
            static=static,
            capture=capture,
            shaping=shaping,
            generator=generator,
        )

    def verify(self, tree: DraftTree, *, static: bool = False, capture: bool = False) -> torch.Tensor:
        """ONE target forward over all nodes of a tree [B, N] -> logits [B, N, V] (`TargetStep.verify`); their
        K/V stay in the cache's pending slots until a commit."""
        return self.target_step.verify(tree, static=static, capture=capture)

    # ------------------------------------------------------------------ launch, settle, catch up
    def launch(
        self,
        method: DecodingMethod,
        candidate: RoundShape,
        roots: torch.Tensor,
        config: GenerationConfig,
        generator: torch.Generator,
        *,
        static: bool,
        clock: PhaseClock,
        slots: BatchSlots | None = None,
        context_len: int = 0,
    ) -> tuple[Round, torch.Tensor]:
        """Queue one round (propose, verify, accept, commit) of `candidate` from `roots` [B], one tree per
        sequence. On static shapes the whole round is ONE static step (one graph launch with cuda_graphs), built
        once per round shape (`_step_key`); eager otherwise, the same function. Nothing is read on the host.
        Returns the round and the next roots [B] on the device. Rows not active in `slots` (finished) commit
        nothing and keep their root. A drafting method's plain and lookup rounds leave the drafter's ring behind:
        their tokens enter only the history, and `catch_up` fills the ring before the next drafter round."""
        capture = config.cuda_graphs
        batch = roots.shape[0]
        active = [True] * batch if slots is None else list(slots.active)
        launched_at = time.perf_counter()
        drafted = method.needs_drafter and candidate.drafts_with_drafter
        depth, children = candidate.depth, candidate.max_children
        layout = candidate.layout if drafted else None
        shaping = _shaping(config) if drafted else None
        # The token history takes the round's tokens wherever it is read (a lookup matches in it; the drafter's
        # ring catches up from it, so a drafting method's plain rounds record their token too); a drafter tree's
        # round enters its path into the ring at once.
        history = (
            self.history
            if method.needs_drafter or (method.drafts is not None and candidate.speculates)
            else None
        )
        ring = self.draft_step if drafted else None
        # The random draws are made here, outside the step, so a replayed graph gets fresh ones. A batch's running
        # rows (a device tensor per pattern) are an input of every round, so a row that finishes changes no step.
        extras: dict[str, torch.Tensor] = {}
        if shaping is not None:
            extras["noise"] = self.draft_step.noise(batch, layout, generator)
        if config.temperature > 0:
            extras["draws"] = uniforms((batch, depth * children + 1), generator, self.device)
        if batch > 1:
            extras["mask"] = slots.mask() if slots is not None else self._every_row(batch)
        names = tuple(extras)

        # Eager rounds time their phases; a static step is timed whole (with graphs: one launch), as verify_s.
        phase = clock.phase if not static else _untimed

        def run(roots, *values):
            given = dict(zip(names, values, strict=True))
            with phase("draft_s"):
                proposals = _Proposals(self, roots, layout, shaping, given.get("noise"), config, static)
                tree = candidate.propose(proposals)
            with phase("verify_s"):
                logits = self.target_step.tree_logits(tree, static=static)
                packed, bonus = accept_round(logits, tree, config, depth, children, given.get("draws"))
            with phase("overhead_s"):
                mask = given.get("mask")
                counts = packed[:, -1] if mask is None else packed[:, -1] * mask
                paths = packed[:, depth + 1 : 2 * (depth + 1)]
                self.commit(tree.tokens, paths, counts, history, ring, in_place=tree.is_one_chain)
                if mask is not None:  # frozen rows keep their root (the step's own copy of it)
                    bonus = torch.where(mask, bonus, roots)
            return packed, bonus

        inputs = (roots, *extras.values())
        if static:
            key = _step_key(candidate, config, names, history, ring, capture)
            # A round's commit changes the caches for good: the step warms up once, on this round's inputs, and
            # that run is this round's (`TargetStep.static_step`).
            with clock.phase("verify_s"):
                packed, bonus = self.target_step.static_step(key, run, inputs, capture, effects=True)
        else:
            packed, bonus = run(*inputs)
        self.cache.device_advanced()
        host, copied = self.host_copies.start(packed)
        return Round(candidate, depth, active, host, copied, launched_at, context_len), bonus

    def settle(self, rnd: Round) -> tuple[list[list[int]], list[list[int]]]:
        """Wait for a launched round's outputs (the round's ONE host sync: emitted tokens, paths and counts
        copied together) and commit its counts on the host. Returns, per sequence, the emitted tokens and the
        accepted path's node slots (a frozen row's are its frozen tree's: ignore them)."""
        out = self.host_copies.read(rnd.packed, rnd.copied)
        self.cache.commit([row[-1] if keep else 0 for row, keep in zip(out, rnd.active, strict=True)])
        depth = rnd.depth
        return [row[: row[-1]] for row in out], [row[depth + 1 : depth + 1 + row[-1]] for row in out]

    def commit(self, tokens, paths, counts, history, ring, *, in_place: bool = False) -> None:
        """The round's commit from device values only (paths [B, depth + 1], counts [B]: 0 for frozen rows), run
        inside the round's step: each row's accepted path moved in the target cache (`StaticKVCache.move_path`),
        unless it is `in_place` (a chain's: its accepted nodes are its first ones, already at the committed
        slots); then one launch of bookkeeping (`kernels.path_commit`): the committed lengths advance, the path's
        tokens enter the token `history` (when given) and, with `ring` (a drafter tree's round), the ring's slots
        for them are claimed, whose K/V the drafter's RoPE step then writes (`DraftStep.write_path`). The host
        lengths follow when the round settles."""
        cache = self.cache
        in_place |= paths.shape[1] == 1  # no drafts: the one node's K/V already sit at each row's length
        if not in_place:
            cache.move_path(paths, cache.lengths_t)
        # the path's tokens, root first (a chain's are its first nodes)
        path_tokens = tokens[:, : paths.shape[1]] if in_place else tokens.gather(1, paths.clamp(min=0))
        rings = (
            {}
            if ring is None
            else dict(ring_positions=ring.cache.positions, ring_appended=ring.cache.num_appended)
        )
        positions, slots = commit_path(
            path_tokens, counts, cache.lengths_t, history=None if history is None else history.tokens, **rings
        )
        if ring is not None:
            ring.write_path(path_tokens, positions, slots)

    def catch_up(self, *, static: bool, capture: bool) -> None:
        """The drafter's ring catches up to the device's committed lengths (`DraftStep.catch_up`), as one static
        step on static shapes (one graph launch with cuda_graphs), with rounds still in flight."""
        draft, cache = self.draft_step, self.cache
        if not static:
            draft.catch_up(cache.lengths_t)
            return
        self.target_step.static_step(
            ("catch_up", capture), draft.catch_up, (cache.lengths_t,), capture, effects=True
        )

    def select_rows(self, index: list[int], roots: torch.Tensor, drafter=None) -> torch.Tensor:
        """Per-slot state follows `BatchSlots.shrink`: the target cache rows, the token history's and the
        drafter's ring rows (moved in place, so the steps of the smaller bucket, built once, serve again), the
        drafter's own per-row state (if it has a `select_rows`), and the roots."""
        moves = compaction(index)
        self.cache.move_rows(moves, len(index))
        self.history.move_rows(moves, len(index))
        if self.draft_step is not None and self.draft_step.cache is not None:
            self.draft_step.move_rows(moves, len(index))
        if hasattr(drafter, "select_rows"):  # a drafter with per-row state of its own
            drafter.select_rows(index)
        return roots.index_select(0, torch.tensor(index, device=self.device))

    def _every_row(self, batch: int) -> torch.Tensor:
        """The mask of a batch whose rows all run (a round launched without slots: the round costs' timing), made
        once per batch size: a host-to-device copy per round would wait for the rounds in flight."""
        if batch not in self._every_row_masks:
            self._every_row_masks[batch] = torch.ones(batch, dtype=torch.bool, device=self.device)
        return self._every_row_masks[batch]

    def _plain_tree(self, roots: torch.Tensor) -> DraftTree:
        """A plain round's one-node tree per row around `roots` [B]: everything but the tokens is the same in every
        round, made once per batch size, so the round launches nothing to build it."""
        parents, depths, ancestor_mask, valid = self.forests(roots.shape[0], 0)
        return DraftTree(roots[:, None], parents, depths, ancestor_mask, valid, chain=True)

    def _lookup(self, roots: torch.Tensor, lookup, max_ngram: int, static: bool) -> DraftTree:
        """A lookup round's forest [B, 1 + length x branches] from `roots` [B] (`pld.lookup_tree` over the
        history, at each row's committed length -- the device lengths on static shapes; one branch: a chain)."""
        parts = self.forests(roots.shape[0], lookup.length, lookup.branches)[:3]  # valid: the lookup's
        lengths = self.target_step.lengths(static)
        if not isinstance(lengths, torch.Tensor):
            lengths = torch.full_like(roots, lengths)
        return lookup_tree(self.history.tokens, lengths, roots, lookup, max_ngram, parts)


def accept_round(
    logits: torch.Tensor,
    tree: DraftTree,
    config: GenerationConfig,
    depth: int,
    max_children: int,
    draws: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The round's acceptance rule on the device, per sequence (the tree's fields [B, N], logits [B, N, V]; greedy
    at T = 0, else `sample_path` with the given uniform `draws` [B, ...], against the tree's `draft_probs` when
    its children were sampled): (packed [B, 2 (depth + 1) + 1] = emitted tokens, path (padded), count; bonus
    [B]); nothing read on the host, fixed shapes. A tree that is one chain (one branch) has no walk
    (`kernels.chain_accept`): greedy, the leading run of matches with its output in one launch; sampled,
    `sample_chain_path` (its decisions in one launch, the bonus in two) and the output in one."""
    tokens, valid, chain = tree.tokens, tree.valid, tree.is_one_chain
    if config.temperature == 0:
        target_argmax = row_argmax(logits)
        if chain:
            return greedy_chain_packed(tokens, target_argmax, valid)
        paths, lengths, bonus = greedy_path(
            tokens, tree.parents, tree.depths, tree.ancestor_mask, target_argmax, valid, depth
        )
    else:
        target_probs = target_distribution(
            logits, temperature=config.temperature, top_k=config.top_k, top_p=config.top_p
        )
        if chain:  # the decisions, the bonus draw and the output: four launches on CUDA
            _, lengths, bonus = sample_chain_path(tokens, valid, target_probs, draws, depth, tree.draft_probs)
            return chain_packed(tokens, lengths, bonus), bonus
        paths, lengths, bonus = sample_path(
            tokens, tree.parents, valid, target_probs, draws, depth=depth, max_children=max_children,
            draft_probs=tree.draft_probs,
        )  # fmt: skip
    emitted = emitted_tokens(tokens, paths, lengths, bonus)
    return torch.cat([emitted, paths, lengths[:, None]], dim=1), bonus


@contextlib.contextmanager
def _untimed(name: str):
    """`PhaseClock.phase`'s stand-in inside a static step (a captured graph must not record the clock's events)."""
    yield


def _shaping(config: GenerationConfig) -> tuple | None:
    """(temperature, top_k, top_p) when longspec's trees are sampled from the drafter's q (the "rrs" rule)."""
    return (config.temperature, config.top_k, config.top_p) if config.rrs else None


@dataclass
class _Proposals:
    """One round's `candidates.Proposer`: its tree from `roots` [B], as its shape asks (`RoundShape.propose`):
    the drafter's over `layout` (with the drafter's `shaping` and `noise` when sampled), a lookup's, or the root
    alone."""

    runner: RoundRunner
    roots: torch.Tensor
    layout: TreeLayout | None
    shaping: tuple | None
    noise: torch.Tensor | None
    config: GenerationConfig
    static: bool

    def plain(self) -> DraftTree:
        return self.runner._plain_tree(self.roots)

    def drafter_tree(self, tree: DrafterTree) -> DraftTree:
        assert self.layout is not None, "a drafter tree's round needs a drafting method"
        runner = self.runner
        n = runner.target_step.lengths(self.static)
        return runner.draft_step.draft_tree(
            self.roots, self.layout, runner.target_step, n, self.shaping, self.noise
        )

    def lookup(self, lookup: Lookup) -> DraftTree:
        return self.runner._lookup(self.roots, lookup, self.config.pld_max_ngram, self.static)


def _step_key(candidate: RoundShape, config, names, history, ring, capture: bool) -> tuple:
    """What a round's static step depends on besides the batch (`TargetStep.static_step` adds it): the round's
    shape, the acceptance rule's and the drafter's sampling settings, what it commits (history, ring) and which
    extra inputs it takes."""
    sampling = (config.temperature, config.top_k, config.top_p) if config.temperature > 0 else ()
    commits = (history is not None, ring is not None)
    shaping = _shaping(config) if ring is not None else None
    return ("round", candidate.shape_key(config.pld_max_ngram), sampling, shaping, commits, names, capture)
