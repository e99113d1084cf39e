"""The sampling acceptance walk down a verified draft tree (`longspec.infer.accept.sample_path`): at each node,
its children tried in candidate order against the target's p (recursive rejection sampling against the
drafter's q, or the deterministic-candidates rule), descending into the accepted child. `naive.py` is the
plain-PyTorch reference (depth x children steps, each about 30 tensor ops, i.e. kernel launches: see `naive.py`);
`triton.py` walks each tree in one program of one launch."""

from longspec.kernels.tree_sampling.naive import child_table, sample_walk_naive

__all__ = ["child_table", "sample_walk", "sample_walk_naive"]


def __getattr__(name):
    # The Triton kernel is imported on first use so that importing this package never imports Triton.
    if name == "sample_walk":
        from longspec.kernels.tree_sampling.triton import sample_walk

        return sample_walk
    raise AttributeError(name)
