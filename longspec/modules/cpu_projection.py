"""Projections of few rows on the CPU (x [M, K] @ W [N, K]^T with M <= MAX_ROWS): which BLAS call computes them
fastest, measured once per shape on the machine that runs them.

Inference multiplies few rows by each weight: one for an AR step, a round's verified tokens for a verify (2-17 in
the rounds tree="auto" runs most). F.linear hands BLAS x @ W^T with M as the GEMM's rows, and for few rows some
builds run that product on one core, or through a GEMV that streams a tall weight slowly. Then a few rows cost
several times one row, a round verifying 2-3 tokens costs nearly as much as that many plain steps, and no
speculation pays. The same product computed as (W @ x^T)^T -- the weight as the GEMM's left operand, N its rows --
runs on every core: `weight_left`. For one row, x is repeated to two columns (a GEMM, not the GEMV; half its
output is dropped), which also beats the GEMV on a tall weight such as an LM head.

Which route wins depends on the BLAS, the core count and the shape (with one thread `weight_left` lost at some
shapes), so nothing is assumed: the first call of each (shape, rows, dtype, threads, bias) times both routes on
its own operands and keeps `weight_left` only where it is at least MARGIN faster, so a route never flips
between runs on a near tie. Each timed call starts from cold caches (EVICT_BYTES written first): in a decode
step the weight was evicted by the layers before it, and a weight served from cache can favour the other route
(`benchmarks/cpu_projection.py` shows such a shape). Both compute the same sums of products; float32 roundings
may differ in the last bits, as F.linear's own kernels already differ between row counts. Only inference takes
a route (no autograd; training's products have thousands of rows).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = [
    "MARGIN",
    "MAX_ROWS",
    "MIN_WEIGHT_BYTES",
    "ROUTES",
    "chosen_routes",
    "faster_route",
    "few_rows_linear",
    "weight_left",
]

# Past ~16 rows F.linear's GEMM threads over the rows as well: the routes are mostly within MARGIN there.
MAX_ROWS = 16
# Smaller weights take F.linear untimed: below ~1 MiB the routes' difference is negligible either way, and the
# tests' tiny models need no timing.
MIN_WEIGHT_BYTES = 1 << 20
MARGIN = 1.25
ROUTES = ("linear", "weight_left")
EVICT_BYTES = 64 << 20  # more than a server CPU's last-level cache slice
_REPS = 3

_chosen: dict[tuple, str] = {}
Timer = Callable[[str, Callable[[], object]], float]


def weight_left(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) computed as (weight @ x^T)^T, one row repeated to two columns ->
    [M, N] contiguous."""
    rows = x.shape[0]
    # [K, M'], a view BLAS reads transposed; one row is copied to two (a zero-stride expand is a slow path)
    columns = (x if rows > 1 else torch.cat([x, x])).T
    if bias is None:
        out = torch.mm(weight, columns)
    else:
        out = torch.addmm(bias[:, None], weight, columns)
    return out[:, :rows].T.contiguous()


def _run(route: str, x, weight, bias) -> torch.Tensor:
    return weight_left(x, weight, bias) if route == "weight_left" else F.linear(x, weight, bias)


def _median_seconds(route: str, fn: Callable[[], object], reps: int = _REPS) -> float:
    """Median seconds of `fn()` (route `route`'s call) over `reps` calls, each after the caches were flushed."""
    fn()  # first call: allocation, BLAS's lazy init
    flush = torch.empty(EVICT_BYTES // 4, dtype=torch.float32)
    times = []
    for _ in range(reps):
        flush.fill_(1.0)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2]


def faster_route(seconds: dict[str, float]) -> str:
    """The route kept from each route's measured seconds: weight-left only where it is >= MARGIN faster."""
    return "weight_left" if seconds["linear"] >= MARGIN * seconds["weight_left"] else "linear"


def _choose(x, weight, bias, timer: Timer) -> str:
    return faster_route(
        {route: timer(route, lambda route=route: _run(route, x, weight, bias)) for route in ROUTES}
    )


def few_rows_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    timer: Timer | None = None,
) -> torch.Tensor | None:
    """x [..., K] @ weight [N, K]^T (+ bias) by the measured faster route, or None where no route is chosen here
    (not a CPU tensor, autograd on, more than MAX_ROWS rows, a weight under MIN_WEIGHT_BYTES): the caller runs
    F.linear. `timer(route, fn)` (the
    seconds of one call of `fn`, route `route`'s product) is for tests."""
    if x.device.type != "cpu" or torch.is_grad_enabled() or x.dtype != weight.dtype:
        return None
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    if not 1 <= rows <= MAX_ROWS or weight.numel() * weight.element_size() < MIN_WEIGHT_BYTES:
        return None
    flat = x.reshape(rows, width)
    key = (tuple(weight.shape), rows, weight.dtype, torch.get_num_threads(), bias is not None)
    route = _chosen.get(key)
    if route is None:
        route = _chosen[key] = _choose(flat, weight, bias, timer or _median_seconds)
    return _run(route, flat, weight, bias).reshape(*x.shape[:-1], weight.shape[0])


def chosen_routes() -> dict[tuple, str]:
    """The routes chosen so far in this process: (weight shape, rows, dtype, threads, bias) -> route."""
    return dict(_chosen)
