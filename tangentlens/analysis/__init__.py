"""Analyses of a model and its tables: interventions, linear probes (scikit-learn),
the depth profile, per-head arrays, embedding geometry."""
