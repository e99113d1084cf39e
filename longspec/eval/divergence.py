"""Why a greedy output differs from the target's greedy reference: a logic error, or a numerical near-tie.

Speculative decoding is lossless in exact arithmetic. In bf16/fp16 the same target computed by different kernels
(one token per step vs a 69-node tree per step, SDPA vs eager vs our Triton attention) rounds differently, and
where the target's two best tokens are within rounding of each other the argmax can flip -- two target-only
baselines flip against each other the same way. So at the first position where an output leaves the reference,
the target is run once more on the reference prefix and the logit gap between the two tokens is measured:
- a gap within `tolerance` (2 units in the last place of the top logit, in the model's dtype) is a near-tie;
- where that forward's argmax is the output's own token, beyond the tolerance, it is the REFERENCE that left the
  target's greedy choice (`reference_off`): the checked output is what a third implementation of the target
  emits there, so the difference is no evidence against it. Seen with a batched bf16 reference: in an
  end-to-end run, graph AR at batch 4 wrote a token that the target run alone ranked 0.5 below the one
  speculative decoding wrote, and the check, which then took every gap beyond the tolerance for the checked
  output's error, reported a lossless failure of speculative decoding;
- anything else (the target prefers the reference's token beyond the tolerance, or the output's token is not
  its argmax) is a real divergence that the lossless check reports as a failure.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from longspec.infer.baselines import using_attn_implementation

__all__ = [
    "TIE_ULPS",
    "Divergence",
    "analyse_divergence",
    "explained",
    "first_divergence",
    "gap_ulps",
    "tie_tolerance",
]

# A near-tie: a logit gap within this many units in the last place of the top logit, in the model's dtype.
TIE_ULPS = 2.0


@dataclass
class Divergence:
    index: int  # first generated position where the output differs from the reference
    reference_token: int | None  # None: the reference ended there (EOS / length)
    token: int | None  # None: the output ended there
    gap: float | None  # target logit[reference_token] - logit[token] on the reference prefix
    tolerance: float | None
    near_tie: bool
    # not a near-tie, and the output's token is the target's argmax on the reference prefix: the reference left
    # the target's greedy choice there, not the output (see the module docstring)
    reference_off: bool = False

    @property
    def explained(self) -> bool:
        return explained(self.to_dict())

    def to_dict(self) -> dict:
        return asdict(self)


def explained(divergence: dict) -> bool:
    """Whether a recorded divergence (`Divergence.to_dict`) is no failure of the checked output: a near-tie, or
    the reference's own departure (`reference_off`, absent from results recorded before it)."""
    return divergence["near_tie"] or divergence.get("reference_off", False)


def first_divergence(output: list[int], reference: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts at the shorter end); None if equal."""
    for i, (a, b) in enumerate(zip(output, reference, strict=False)):
        if a != b:
            return i
    return None if len(output) == len(reference) else min(len(output), len(reference))


def tie_tolerance(top_logit: float, dtype: torch.dtype) -> float:
    """TIE_ULPS units in the last place of `top_logit` in `dtype`: the rounding two implementations can disagree
    by."""
    eps = torch.finfo(dtype).eps
    return TIE_ULPS * eps * max(abs(top_logit), 1.0)


def gap_ulps(gap: float, tolerance: float) -> float:
    """A logit gap in units in the last place of the top logit (`tolerance` is TIE_ULPS of them)."""
    return TIE_ULPS * abs(gap) / tolerance


@torch.no_grad()
def analyse_divergence(
    hf_model, prompt_ids: list[int], output: list[int], reference: list[int], *, tie_dtype=None
) -> Divergence | None:
    """Compare `output` with the greedy `reference` (both continuations of `prompt_ids`) -> None when identical.

    One forward of the target (SDPA, its own dtype) over prompt + reference[:index] gives the logits both
    tokens competed on at the first differing position. `tie_dtype`: the dtype whose rounding the outputs were
    computed in, which sets the near-tie tolerance (default: the model's). A bf16 run analysed with the target
    in float32 measures the gap without bf16 rounding, and judges it against bf16's."""
    index = first_divergence(output, reference)
    if index is None:
        return None
    ref_token = reference[index] if index < len(reference) else None
    token = output[index] if index < len(output) else None
    if ref_token is None or token is None:  # one stopped early: not a tie between two tokens
        return Divergence(index, ref_token, token, None, None, near_tie=False)
    device = next(hf_model.parameters()).device
    ids = torch.tensor([*prompt_ids, *reference[:index]], dtype=torch.long, device=device)[None]
    with using_attn_implementation(hf_model, "sdpa"):  # eager would materialise H x L x L scores
        logits = hf_model(ids, use_cache=False, logits_to_keep=1).logits[0, -1]
    gap = float(logits[ref_token].float() - logits[token].float())
    tolerance = tie_tolerance(float(logits.float().max()), tie_dtype or logits.dtype)
    near_tie = abs(gap) <= tolerance
    # a token tied with the argmax counts as the argmax (argmax's choice among equals is arbitrary)
    reference_off = not near_tie and float(logits[token]) == float(logits.max())
    return Divergence(index, ref_token, token, gap, tolerance, near_tie=near_tie, reference_off=reference_off)
