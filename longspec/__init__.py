"""longspec: LongSpec drafter training and lossless long-context speculative decoding.

Importing the package is cheap and offline: heavy modules (deepspeed, datasets, triton) are imported
where they are used.
"""

__version__ = "0.1.0"
