import pytest
import torch


@pytest.mark.parametrize("vocab", [1024, 1500, 4099])  # a whole number of blocks, and two that need padding
def test_every_route_returns_argmax(load_benchmark, vocab):
    """The routes the GPU benchmark times must compute argmax: the two-stage max pads a vocabulary that is not a
    whole number of blocks, and the winner may sit in the padded last block."""
    row_argmax = load_benchmark("row_argmax")
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(5, vocab, generator=gen)
    x[0, -1] = 10.0  # the maximum in the last (padded) block
    x[1, 0] = 10.0
    for name, route in row_argmax.ROUTES.items():
        assert torch.equal(route(x), x.argmax(-1)), name
