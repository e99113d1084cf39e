"""Adaptive speculation (`tree="auto"`): each round, the candidate round shape with the most expected tokens per
second. One job per module:

- `acceptance`: the acceptance model (per-depth rank hazards) and the yield calibration;
- `costs`: the measured round costs per context bucket and the costs learned while decoding;
- `adaptive`: the rule (argmax expected tokens / cost, explorations out of plain decoding) and the fixed policy;
- `shadow`: what a lookup would have accepted at the rounds that ran none;
- `measure`: the round costs measured on an engine, and the call's policy.
"""

from longspec.infer.policy.acceptance import AcceptanceModel, YieldCalibration
from longspec.infer.policy.adaptive import AdaptivePolicy, FixedPolicy
from longspec.infer.policy.costs import CostModel, MeasuredCosts, RoundTimes, context_bucket, named_by_bucket
from longspec.infer.policy.shadow import LookupShadow, ShadowReport

__all__ = [
    "AcceptanceModel",
    "AdaptivePolicy",
    "CostModel",
    "FixedPolicy",
    "LookupShadow",
    "MeasuredCosts",
    "RoundTimes",
    "ShadowReport",
    "YieldCalibration",
    "context_bucket",
    "named_by_bucket",
]
