"""Benchmarks behind `txbox bench <stage>`.

Each stage module exposes ``configure(parser)`` and ``run(args) -> Result``; every result
carries the machine's raw limit for that stage measured in the same run, so the ratio
is comparable across noisy shared machines.
"""
