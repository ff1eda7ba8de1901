"""Benchmarks: ``python -m lightning_par.bench NAME [options]``.

Each benchmark measures our implementation and its peer (torch, Lightning) in the same
run and reports ratios. ``NAME`` is a module of this package exposing ``main(argv)``.
"""
