"""The inductor backend: segments of the compiled graph compiled by torch's inductor, host nodes in torch.

``executor`` (partition, compile per segment, the checked first run, fallback).  Importing it
imports ``torch._inductor``.
"""
