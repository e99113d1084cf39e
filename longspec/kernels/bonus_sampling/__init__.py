"""The bonus token of a sampled chain round (`longspec.infer.accept.sample_chain_path`): one draw from the stop
node's residual, max(p - q, 0) after a rejected draft (recursive rejection sampling; p without the draft under the
deterministic-candidates rule), else p itself. `naive.py` is the plain-PyTorch reference (about fifteen V-wide
float64 ops, each a launch: a large share of a T=1 round's acceptance work); `triton.py` draws it in two
launches spread over the device."""

from longspec.kernels.bonus_sampling.naive import inverse_cdf, sample_bonus_naive

__all__ = ["inverse_cdf", "sample_bonus", "sample_bonus_naive"]


def __getattr__(name):
    # The Triton kernel is imported on first use so that importing this package never imports Triton.
    if name == "sample_bonus":
        from longspec.kernels.bonus_sampling.triton import sample_bonus

        return sample_bonus
    raise AttributeError(name)
