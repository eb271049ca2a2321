"""The numerical core and the file layer: no model code, no torch model.

Errors, validation, settings, files (atomic writes, hashes, locks), compute, the
statistics catalogue, `Moments`, metrics, subspaces, controls, results, tests,
intervals and the attention maths.
"""
